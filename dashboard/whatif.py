"""The "What if" view's data: a `kvlease replay` run in the background, and its report as
DataFrames.

The page never replays in its own process (a replay loads vLLM, and the dashboard
must not): `ReplayJob` starts `kvlease replay --json FILE` as a child process and
reads the file when the child ends, and its progress bar's last line meanwhile.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from exporters.ledger import DB_ENV

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


@dataclass
class ReplayJob:
    """One background `kvlease replay` and its folder. `poll()` never blocks."""

    folder: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="kvlease-whatif-")))
    process: subprocess.Popen | None = None
    report: dict[str, Any] | None = None  # read once, when the child has ended

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
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        return self

    def poll(self) -> tuple[str, Any]:
        """("running", the progress line), ("done", the report) or ("failed", the error)."""
        code = self.process.poll() if self.process else None
        if code is None:
            return "running", self._last_line()
        if code == 0 and self.report_path.exists():
            if self.report is None:
                self.report = json.loads(self.report_path.read_text())
            return "done", self.report
        return "failed", self._last_line() or f"kvlease replay exited with status {code}"

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()

    def _last_line(self) -> str:
        """The log's last non-empty line, or of a progress bar its last redraw."""
        try:
            text = self.log_path.read_bytes()[-4096:].decode("utf-8", "replace")
        except OSError:
            return ""
        parts = [p.strip() for p in text.replace("\r", "\n").split("\n") if p.strip()]
        return parts[-1] if parts else ""


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
