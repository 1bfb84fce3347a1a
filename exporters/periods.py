"""Charge periods and time windows: UTC hours, days and months as epoch seconds, and the
`--from`/`--to`/`--month` strings people type."""

from __future__ import annotations

import calendar
import functools
import math
from datetime import UTC, datetime

from kvlease.exporters.rollups import DAY, HOUR

GRANULARITIES = ("hour", "day", "month")


@functools.lru_cache(maxsize=4096)  # an export stamps the same few period edges again and again
def stamp(epoch: float) -> str:
    """FOCUS timestamps: UTC, `YYYY-MM-DDTHH:MM:SSZ`."""
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def period(epoch: float, granularity: str) -> tuple[float, float]:
    """[start, end) of the hour, day or month containing `epoch`, as epoch seconds (UTC
    hours and days are whole multiples of seconds since the epoch: no calendar needed)."""
    if granularity in ("hour", "day"):
        length = HOUR if granularity == "hour" else DAY
        start = math.floor(epoch / length) * length
        return float(start), float(start + length)
    t = datetime.fromtimestamp(epoch, UTC)
    if granularity == "month":
        first = t.replace(day=1, hour=0, minute=0, second=0, microsecond=0).timestamp()
        return first, first + calendar.monthrange(t.year, t.month)[1] * DAY
    raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")


def parse_time(value: str) -> float:
    """Epoch seconds of a UTC date or an ISO time (a time without a zone is UTC)."""
    try:
        moment = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"not a date or ISO time: {value!r} (try 2026-11-01)") from None
    return (moment if moment.tzinfo else moment.replace(tzinfo=UTC)).timestamp()


def month_window(month: str) -> tuple[float, float]:
    """[first, next first) of a calendar month given as `YYYY-MM`, as epoch seconds."""
    try:
        first = datetime.strptime(month, "%Y-%m").replace(tzinfo=UTC)
    except ValueError:
        raise ValueError(f"a month is YYYY-MM, got {month!r} (try 2026-11)") from None
    return period(first.timestamp(), "month")


def parse_window(start: str | None, end: str | None) -> tuple[float, float]:
    """[start, end) as epoch seconds from UTC dates or ISO times; default: this month."""
    this_month = period(datetime.now(UTC).timestamp(), "month")
    lo = parse_time(start) if start else this_month[0]
    hi = parse_time(end) if end else this_month[1]
    if hi <= lo:
        raise ValueError("--to must be after --from")
    return lo, hi
