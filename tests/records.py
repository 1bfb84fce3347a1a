"""Usage records for ledger and billing tests."""

from __future__ import annotations

from kvlease.exporters.ledger import UsageRecord

NOV = 1793491200.0  # 2026-11-01T00:00:00Z


def rec(i: int, tenant="acme", tier="premium", model="m", at=NOV + 3600, **kw) -> UsageRecord:
    base = dict(
        request_id=f"kvl-{i:032x}",
        tenant_id=tenant,
        tier=tier,
        session_id=None,
        model=model,
        started_at=at - 2,
        ended_at=at,
        input_tokens=1000,
        cached_input_tokens=400,
        output_tokens=500,
        recomputed_tokens=70,
        preemptions=1,
        kv_block_seconds=36.0,
        outcome="completed",
    )
    return UsageRecord(**{**base, **kw})


def retention(i: int, reserved: float, retained: float, **kw) -> UsageRecord:
    """A retention record: a session's blocks between turns, no tokens."""
    zero = dict.fromkeys(
        ("input_tokens", "cached_input_tokens", "output_tokens", "recomputed_tokens"), 0
    )
    return rec(
        i,
        **{
            **zero,
            "preemptions": 0,
            "kv_block_seconds": 0.0,
            "outcome": "retention",
            "request_id": f"kvl-{i:032x}:retention",
            "kv_reserved_block_seconds": reserved,
            "kv_retained_block_seconds": retained,
            **kw,
        },
    )
