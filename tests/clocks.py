"""Clocks tests move by hand, for code that takes an injectable clock."""

from __future__ import annotations

import time


class ManualClock:
    """Stands still until the test sets `now`."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class OffsetClock:
    """Real monotonic time plus an `offset` the test moves forward."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.offset
