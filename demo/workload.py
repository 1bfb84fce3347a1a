"""A seeded multi-tenant chat trace: who asks what, and when.

Tenants in three tiers open chat sessions at Poisson-distributed times; a
session is a few turns apart by an exponential think time; each turn adds a
user message and asks for a reply, both with heavy-tailed (lognormal) lengths.
The same seed gives the same trace, so the demo, the tests and the benchmarks
(bench/) all replay one workload. A trace can also come from a CSV file
(timestamp, tenant, session, input_tokens, output_tokens[, tier]), such as one
converted from BurstGPT or Mooncake.

Pure: no vLLM, no network. `demo/client.py` plays a trace against a server.
"""

from __future__ import annotations

import csv
import math
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from kvlease.engine.tenancy import TierTable

# The shipped tier table's tiers, most important first: the demo trace's three classes.
TIERS = tuple(TierTable.shipped())


@dataclass(frozen=True)
class Turn:
    """One request of the trace. `input_tokens` is what the user adds this turn; the
    request also carries the session's earlier turns (its prefix)."""

    at: float  # seconds from the start of the trace
    tenant_id: str
    tier: str
    session_id: str
    turn: int  # 0 for a session's first request
    input_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class WorkloadSpec:
    tenants: tuple[int, int, int] = (4, 8, 20)  # premium, standard, free
    duration: float = 60.0  # sessions start within this many seconds
    sessions_per_second: float = 0.5  # Poisson arrivals, across all tenants
    mean_turns: float = 3.0  # geometric
    mean_think_seconds: float = 4.0  # exponential, between a reply and the next turn
    input_median: int = 40  # lognormal
    input_sigma: float = 0.8
    output_median: int = 100
    output_sigma: float = 0.6
    max_tokens: int = 512  # cap for both
    seed: int = 0

    @classmethod
    def for_tenants(cls, total: int, **kw) -> WorkloadSpec:
        """`total` tenants split about 1:3:8 over premium, standard and free (one of each
        at least)."""
        if total < 3:
            raise ValueError("a workload needs at least 3 tenants, one per tier")
        premium = max(1, round(total / 12))
        standard = max(1, round(total / 4))
        return cls(tenants=(premium, standard, total - premium - standard), **kw)


def tenant_names(spec: WorkloadSpec) -> list[tuple[str, str]]:
    """(tenant id, tier) for every tenant of the spec, e.g. ("premium-00", "premium")."""
    return [
        (f"{tier}-{i:02d}", tier)
        for tier, n in zip(TIERS, spec.tenants, strict=True)
        for i in range(n)
    ]


def generate(spec: WorkloadSpec) -> list[Turn]:
    """The trace, sorted by time. Turn times assume each reply takes no time; a player
    waits for the previous reply before sending the next turn."""
    turns = [turn for session in stream_sessions(spec) for turn in session]
    return sorted(turns, key=lambda x: (x.at, x.session_id, x.turn))


def stream_sessions(spec: WorkloadSpec) -> Iterator[list[Turn]]:
    """Sessions in order of their first turn, lazily: `duration` may be infinite."""
    rng = random.Random(spec.seed)
    tenants = tenant_names(spec)
    t, n = 0.0, 0
    while True:
        t += rng.expovariate(spec.sessions_per_second)
        if t >= spec.duration:
            return
        tenant, tier = rng.choice(tenants)
        session = f"{tenant}-s{n:04d}"
        n += 1
        at, turns = t, []
        for k in range(1 + _geometric(rng, spec.mean_turns)):
            turns.append(
                Turn(
                    round(at, 3),
                    tenant,
                    tier,
                    session,
                    k,
                    _lognormal(rng, spec.input_median, spec.input_sigma, spec.max_tokens),
                    _lognormal(rng, spec.output_median, spec.output_sigma, spec.max_tokens),
                )
            )
            at += rng.expovariate(1 / spec.mean_think_seconds)
        yield turns


def _geometric(rng: random.Random, mean: float) -> int:
    """Extra turns beyond the first: geometric with the given mean number of turns."""
    p = 1 / max(1.0, mean)
    return int(math.log(1 - rng.random()) / math.log(1 - p)) if p < 1 else 0


def _lognormal(rng: random.Random, median: int, sigma: float, cap: int) -> int:
    return max(1, min(cap, round(rng.lognormvariate(math.log(median), sigma))))


def sessions(turns: Iterable[Turn]) -> dict[str, list[Turn]]:
    """Turns grouped by session, in turn order."""
    out: dict[str, list[Turn]] = {}
    for turn in sorted(turns, key=lambda x: (x.session_id, x.turn)):
        out.setdefault(turn.session_id, []).append(turn)
    return out


TRACE_COLUMNS = ("timestamp", "tenant", "session", "input_tokens", "output_tokens", "tier")


def save_trace(turns: Iterable[Turn], path: Path) -> None:
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(TRACE_COLUMNS)
        for t in turns:
            writer.writerow(
                [t.at, t.tenant_id, t.session_id, t.input_tokens, t.output_tokens, t.tier]
            )


def load_trace(path: Path, default_tier: str = "standard") -> list[Turn]:
    """A trace file: timestamp (seconds, any origin), tenant, session, input_tokens,
    output_tokens and optionally tier. Turn numbers follow row order per session."""
    rows = []
    with path.open(newline="") as f:
        for i, row in enumerate(csv.DictReader(f), 2):
            try:
                rows.append(
                    (
                        float(row["timestamp"]),
                        row["tenant"],
                        row.get("tier") or default_tier,
                        row["session"],
                        int(row["input_tokens"]),
                        int(row["output_tokens"]),
                    )
                )
            except (KeyError, ValueError, TypeError) as exc:
                raise ValueError(f"{path}:{i}: bad trace row ({exc})") from None
    if not rows:
        return []
    origin = min(r[0] for r in rows)
    seen: dict[str, int] = {}
    turns = []
    for at, tenant, tier, session, inp, out in sorted(rows, key=lambda r: r[0]):
        k = seen[session] = seen.get(session, -1) + 1
        turns.append(Turn(round(at - origin, 3), tenant, tier, session, k, inp, out))
    return turns


def describe(turns: list[Turn]) -> dict[str, object]:
    """Counts for a one-line description of a trace."""
    by_tier = {tier: sum(1 for t in turns if t.tier == tier) for tier in TIERS}
    return {
        "requests": len(turns),
        "sessions": len({t.session_id for t in turns}),
        "tenants": len({t.tenant_id for t in turns}),
        "by_tier": by_tier,
        "span_seconds": max((t.at for t in turns), default=0.0),
    }
