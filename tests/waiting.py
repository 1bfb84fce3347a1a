"""Waiting for a state, not for a time: tests poll what they expect, and a deadline only
turns a hang into a failure (never a measure of speed)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait(check: Callable[[], T], seconds: float, interval: float = 0.05) -> T:
    """`check()`'s first truthy value, or its last falsy one after `seconds`."""
    deadline = time.monotonic() + seconds
    while not (result := check()) and time.monotonic() < deadline:
        time.sleep(interval)
    return result


def until(check: Callable[[], T], what: str, seconds: float = 120, interval: float = 0.1) -> T:
    """`check()`'s first truthy value; fails naming `what` if none comes in `seconds`."""
    result = wait(check, seconds, interval)
    assert result, f"never happened: {what}"
    return result


async def ticks_until(check: Callable[[], object], what: str, ticks: int = 100_000) -> None:
    """Yield to the event loop until `check()` holds: counted in loop turns, not seconds,
    so a busy machine cannot make it pass or fail."""
    for _ in range(ticks):
        if check():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"never happened in {ticks} event-loop turns: {what}")
