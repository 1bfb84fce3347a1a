"""The traffic a replay plays: a ledger's records for a window, or a trace CSV, as turns.

Both become `kvlease.demo.workload.Turn`s, the trace format bench/ reads. From the
ledger, a session's turns are its records in start order; a turn's new user
tokens are its prompt less the previous turn's prompt and reply (a chat resends
its context), and its time after the previous turn is the user's think time
(start minus the previous end). So `kvlease.replay.sessions.StepTrace` rebuilds the
shared prefixes and the closed loop the live engine saw.

Every bad input raises `ReplayInputError` with one line that names it.
"""

from __future__ import annotations

import tomllib
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import replace
from pathlib import Path

from kvlease.demo.workload import Turn, load_trace
from kvlease.engine.tenancy import TierTable


class ReplayInputError(ValueError):
    """Traffic, a window or a tier assignment the replay cannot use."""


def from_trace(path: Path) -> list[Turn]:
    try:
        turns = load_trace(path)
    except OSError as exc:
        raise ReplayInputError(f"cannot read {path}: {exc.strerror}") from None
    except ValueError as exc:
        raise ReplayInputError(str(exc)) from None
    if not turns:
        raise ReplayInputError(f"{path}: no requests in the trace")
    return turns


def from_ledger(url: str | None, window: tuple[float, float]) -> tuple[list[Turn], int]:
    """The turns of the records that ended in `window`, and how many records were left
    out because they carry no tier (unclassified traffic has no place in a tier table)."""
    from kvlease.exporters.ledger import UsageLedger

    records = list(UsageLedger(url, create=False).read(*window))
    classified = [r for r in records if r.tier]
    if not classified:
        raise ReplayInputError(
            f"no usage records ended in the window [{_day(window[0])}, {_day(window[1])})"
        )
    return turns_of(classified), len(records) - len(classified)


def turns_of(records: Iterable) -> list[Turn]:
    """Usage records (anything with the ledger's fields) as turns; see the module doc."""
    sessions: dict[str, list] = defaultdict(list)
    for r in records:  # a record without a session is a session of one turn
        sessions[f"{r.tenant_id}/{r.session_id or r.request_id}"].append(r)
    origin = min(r.started_at for rs in sessions.values() for r in rs)
    turns = []
    for key, rs in sessions.items():
        rs.sort(key=lambda r: r.started_at)
        at, context = rs[0].started_at - origin, 0
        for k, r in enumerate(rs):
            if k:
                at += max(0.0, r.started_at - rs[k - 1].ended_at)
            new = max(1, r.input_tokens - context)
            out = max(1, r.output_tokens)  # vLLM needs max_tokens >= 1
            turns.append(Turn(round(at, 3), r.tenant_id, r.tier, key, k, new, out))
            context = r.input_tokens + r.output_tokens
    return sorted(turns, key=lambda t: (t.at, t.session_id, t.turn))


def load_assignment(path: Path, tiers: TierTable) -> dict[str, str]:
    """`[tenants]` `name = "tier"` from a TOML file; every tier must be in `tiers`."""
    try:
        doc = tomllib.loads(read_text(path))
    except tomllib.TOMLDecodeError as exc:
        raise ReplayInputError(f"{path}: not valid TOML: {exc}") from None
    tenants = doc.get("tenants")
    if not isinstance(tenants, dict) or not tenants:
        raise ReplayInputError(f'{path}: expected a [tenants] table of name = "tier"')
    for tenant, tier in tenants.items():
        if tier not in tiers:
            raise ReplayInputError(
                f"{path}: tenant {tenant!r}: unknown tier {tier!r} (known: {', '.join(tiers)})"
            )
    return dict(tenants)


def read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ReplayInputError(f"cannot read {path}: {exc.strerror}") from None


def assign(turns: list[Turn], tiers: Mapping[str, str]) -> list[Turn]:
    """The turns with the named tenants moved to their new tiers."""
    return [replace(t, tier=tiers[t.tenant_id]) if t.tenant_id in tiers else t for t in turns]


def check_tiers(turns: list[Turn], tiers: TierTable, which: str) -> None:
    unknown = sorted({t.tier for t in turns} - set(tiers))
    if unknown:
        raise ReplayInputError(
            f"the {which} tier table has no tier {unknown[0]!r}, which the traffic uses "
            f"(known: {', '.join(tiers)}); move its tenants with --assign"
        )


def _day(epoch: float) -> str:
    from kvlease.exporters.periods import stamp

    return stamp(epoch)
