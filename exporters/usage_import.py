"""`kvlease usage import`: raw usage records from CSV into the ledger, idempotently.

The file is what `kvlease usage export --format raw` writes (the same columns, any
order, extra columns refused), so an export re-imported adds nothing: the request id
is the ledger's idempotency key. For backfills, migrations from another metering
system, and traffic for `kvlease replay`.

Each bad row is reported as one line (its line number and why) and skipped; the good
rows are imported. Times are the export's `YYYY-MM-DDTHH:MM:SSZ`, any ISO 8601 time
with a zone, or epoch seconds. A cell the export made inert for spreadsheets (a
leading quote before =, +, -, @) is read back as it was.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Iterable, Iterator
from dataclasses import fields
from datetime import datetime

from engine.tenancy import Prices
from exporters.billing import FORMULA_STARTS, RAW_COLUMNS
from exporters.join import OUTCOMES
from exporters.ledger import UsageRecord

LIMITS = {"request_id": 200, "tenant_id": 128, "tier": 32, "session_id": 128, "model": 200}
COUNTS = tuple(f.name for f in fields(UsageRecord) if f.type == "int")  # token figures...
TRUE, FALSE = {"true", "1", "yes"}, {"false", "0", "no", ""}


class BadFile(ValueError):
    """The file as a whole cannot be read (no header, wrong columns)."""


class BadRow(ValueError):
    """One row cannot be a record; the message says why."""


def read_records(lines: Iterable[str]) -> Iterator[tuple[int, UsageRecord | BadRow]]:
    """(line number, record or the reason it is not one) per data row, streamed."""
    reader = csv.DictReader(lines)
    header = reader.fieldnames or []
    missing = [c for c in RAW_COLUMNS if c not in header]
    extra = [c for c in header if c not in RAW_COLUMNS]
    if missing or extra:
        raise BadFile(
            "the header is not `kvlease usage export --format raw`'s: "
            + "; ".join(
                part
                for part in (
                    missing and f"missing {', '.join(missing)}",
                    extra and f"unknown {', '.join(extra)}",
                )
                if part
            )
        )
    for row in reader:
        try:
            yield reader.line_num, parse_row(row)
        except BadRow as exc:
            yield reader.line_num, exc


def parse_row(row: dict[str, str | None]) -> UsageRecord:
    if None in row:
        raise BadRow("more cells than columns")
    cells = {k: _restore(v or "") for k, v in row.items()}
    for name, limit in LIMITS.items():
        if len(cells[name]) > limit:
            raise BadRow(f"{name} is longer than {limit} characters")
    for name in ("request_id", "tenant_id", "model"):
        if not cells[name]:
            raise BadRow(f"{name} is empty")
    counts = {name: _count(name, cells[name]) for name in COUNTS}
    if counts["cached_input_tokens"] > counts["input_tokens"]:
        raise BadRow("cached_input_tokens is more than input_tokens")
    started, ended = _time("started_at", cells["started_at"]), _time("ended_at", cells["ended_at"])
    if ended < started:
        raise BadRow("ended_at is before started_at")
    if cells["outcome"] not in OUTCOMES:
        raise BadRow(f"outcome {cells['outcome']!r} is not one of {', '.join(OUTCOMES)}")
    return UsageRecord(
        request_id=cells["request_id"],
        tenant_id=cells["tenant_id"],
        tier=cells["tier"] or None,
        session_id=cells["session_id"] or None,
        model=cells["model"],
        started_at=started,
        ended_at=ended,
        kv_block_seconds=_block_seconds(cells["kv_block_seconds"]),
        outcome=cells["outcome"],
        partial=_flag(cells["partial"]),
        price_basis=_basis(cells["price_basis"]),
        **counts,
    )


def _restore(cell: str) -> str:
    """Undo the export's spreadsheet guard ('=x -> =x)."""
    return cell[1:] if cell[:1] == "'" and cell[1:2] in FORMULA_STARTS and cell[1:] else cell


def _count(name: str, cell: str) -> int:
    try:
        value = int(cell)
    except ValueError:
        raise BadRow(f"{name} is not a whole number: {cell[:40]!r}") from None
    if value < 0:
        raise BadRow(f"{name} is negative")
    return value


def _time(name: str, cell: str) -> float:
    try:
        return float(cell)
    except ValueError:
        pass
    try:
        moment = datetime.fromisoformat(cell.replace("Z", "+00:00"))
    except ValueError:
        raise BadRow(f"{name} is not a time: {cell[:40]!r} (2026-11-01T12:00:00Z)") from None
    if moment.tzinfo is None:
        raise BadRow(f"{name} has no time zone: {cell[:40]!r} (end it with Z for UTC)")
    return moment.timestamp()


def _block_seconds(cell: str) -> float:
    try:
        value = float(cell)
    except ValueError:
        raise BadRow(f"kv_block_seconds is not a number: {cell[:40]!r}") from None
    if not math.isfinite(value) or value < 0:
        raise BadRow("kv_block_seconds must be a finite number >= 0")
    return value


def _flag(cell: str) -> bool:
    if cell.lower() in TRUE:
        return True
    if cell.lower() in FALSE:
        return False
    raise BadRow(f"partial is not true or false: {cell[:40]!r}")


def _basis(cell: str) -> str | None:
    if not cell:
        return None
    try:
        Prices.from_basis(cell)
    except (ValueError, TypeError, KeyError, AttributeError, ArithmeticError):
        raise BadRow("price_basis is not a price basis the ledger wrote") from None
    return cell
