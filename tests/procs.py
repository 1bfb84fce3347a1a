"""What the stop tests read of real processes, from /proc: which still run, whose
children they are, what they run as, and whether a port is free again."""

from __future__ import annotations

import socket
from pathlib import Path


def _stat(pid: int) -> list[str] | None:
    """The fields after the command name (state, parent, ...); None once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def running(pids: list[int]) -> list[int]:
    """Those of `pids` still running (a zombie has ended: only its status is left)."""
    return [p for p in pids if (fields := _stat(p)) is not None and fields[0] != "Z"]


def describe(pids: list[int]) -> str:
    """Each of `pids` with its state and what it waits in, for a failure message."""
    out = []
    for pid in pids:
        fields = _stat(pid) or ["gone"]
        try:
            wchan = Path(f"/proc/{pid}/wchan").read_text()
        except OSError:
            wchan = ""
        out.append(f"{pid} [{fields[0]} {wchan}] {cmdline(pid)[:100]}")
    return "; ".join(out)


def parent_of(pid: int) -> int | None:
    fields = _stat(pid)
    return int(fields[1]) if fields else None


def group(pgid: int) -> list[int]:
    """The processes of process group `pgid`."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := _stat(int(entry.name))) and int(fields[2]) == pgid:
            out.append(int(entry.name))
    return out


def children(pid: int, marked: bytes = b"") -> list[int]:
    """`pid`'s children (whose command line holds `marked`)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or parent_of(int(entry.name)) != pid:
            continue
        if marked in cmdline(int(entry.name)).encode():
            out.append(int(entry.name))
    return out


def cmdline(pid: int) -> str:
    """What `pid` runs as (its title, for vLLM's processes); empty once it is gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
