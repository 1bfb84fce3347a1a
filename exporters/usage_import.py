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
import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import fields
from datetime import datetime
from typing import Any

from kvlease.engine.tenancy import Prices
from kvlease.exporters.billing import FORMULA_STARTS, RAW_COLUMNS
from kvlease.exporters.join import OUTCOMES
from kvlease.exporters.ledger import RETENTION, UsageRecord, causes_text

LIMITS = {"request_id": 200, "tenant_id": 128, "tier": 32, "session_id": 128, "model": 200}
COUNTS = tuple(f.name for f in fields(UsageRecord) if f.type == "int")  # token figures...
TRUE, FALSE = {"true", "1", "yes"}, {"false", "0", "no", ""}
# Columns an earlier kvlease's raw export did not write, read with the defaults the
# ledger's migrations gave its old records.
OPTIONAL_COLUMNS = {
    "partial": "false",
    "price_basis": "",
    "lease_covered_tokens": "0",
    "kv_reserved_block_seconds": "0",
    "kv_retained_block_seconds": "0",
    "recomputed_by": "",
}
RECORD_OUTCOMES = (*OUTCOMES, RETENTION)
BLOCK_SECONDS = ("kv_block_seconds", "kv_reserved_block_seconds", "kv_retained_block_seconds")
# Bounds that keep every bill computable. A count fits the ledger's INTEGER columns
# (PostgreSQL's are 32-bit), so a window's sum of them stays within 64 bits for 4 billion
# records; block-seconds stay below 1e9 (31 years of one block), so the rollups' integer
# block-microseconds sum exactly over 9,000 records at that bound; a time lies between
# 1970 and 9999, what the exports can print.
MAX_COUNT = 2**31 - 1
MAX_BLOCK_SECONDS = 1e9
TIME_RANGE = (0.0, 253402300799.0)  # 1970-01-01T00:00:00Z .. 9999-12-31T23:59:59Z


class BadFile(ValueError):
    """The file as a whole cannot be read (no header, wrong columns)."""


class BadRow(ValueError):
    """One row cannot be a record; the message says why."""


def read_records(lines: Iterable[str]) -> Iterator[tuple[int, UsageRecord | BadRow]]:
    """(line number, record or the reason it is not one) per data row, streamed. The
    header is read and checked now (BadFile), the rows as they are iterated."""
    reader = csv.DictReader(lines)
    try:
        header = reader.fieldnames or []
    except (csv.Error, UnicodeDecodeError) as exc:
        raise BadFile(f"the header does not read as CSV: {exc}") from None
    missing = [c for c in RAW_COLUMNS if c not in header and c not in OPTIONAL_COLUMNS]
    extra = [c for c in header if c not in RAW_COLUMNS]
    if len(set(header)) != len(header):
        raise BadFile("the header names a column twice")
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
    defaults = {c: v for c, v in OPTIONAL_COLUMNS.items() if c not in header}
    return _rows(reader, defaults)


def _rows(
    reader: csv.DictReader[str], defaults: dict[str, str]
) -> Iterator[tuple[int, UsageRecord | BadRow]]:
    seen: dict[str, int] = {}  # request id -> line, within the current batch of ids
    while True:
        try:
            row = next(reader)
        except StopIteration:
            return
        except csv.Error as exc:  # a cell over csv's field limit, a NUL byte
            # DictReader updates its own line_num only after a good row.
            yield reader.reader.line_num, BadRow(f"not a CSV row: {exc}")
            continue
        try:
            record = parse_row({**row, **defaults} if defaults else row)
        except BadRow as exc:
            yield reader.line_num, exc
            continue
        first = seen.setdefault(record.request_id, reader.line_num)
        if first != reader.line_num:
            yield reader.line_num, BadRow(f"request_id repeats line {first}'s")
            continue
        if len(seen) >= DUPLICATE_WINDOW:
            seen.clear()
        yield reader.line_num, record


# Repeated request ids are reported by line within this many rows; a repeat further
# apart is the ledger's (counted as already there), as a re-import's rows are.
DUPLICATE_WINDOW = 1_000_000
_NOT_UTF8 = re.compile("[\udc80-\udcff]")


def parse_row(row: dict[str, str | None]) -> UsageRecord:
    if None in row:
        raise BadRow("more cells than columns")
    if None in row.values():
        raise BadRow("fewer cells than columns")
    cells = {k: _restore(v) if v[:1] == "'" else v for k, v in row.items() if v is not None}
    text = "".join(cells.values())
    if not text.isascii() and _NOT_UTF8.search(text):
        # A file read with errors="surrogateescape" keeps bytes that are not UTF-8 as lone
        # surrogates: such a row is refused by line, not with a traceback.
        name = next(k for k, v in cells.items() if _NOT_UTF8.search(v))
        raise BadRow(f"{name} is not UTF-8 text")
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
    if cells["outcome"] not in RECORD_OUTCOMES:
        raise BadRow(f"outcome {cells['outcome']!r} is not one of {', '.join(RECORD_OUTCOMES)}")
    figures: dict[str, Any] = {name: _block_seconds(name, cells[name]) for name in BLOCK_SECONDS}
    return UsageRecord(
        request_id=cells["request_id"],
        tenant_id=cells["tenant_id"],
        tier=cells["tier"] or None,
        session_id=cells["session_id"] or None,
        model=cells["model"],
        started_at=started,
        ended_at=ended,
        outcome=cells["outcome"],
        partial=_flag(cells["partial"]),
        price_basis=_basis(cells["price_basis"]),
        **counts,
        **figures,
        recomputed_by=_causes(cells["recomputed_by"], counts["recomputed_tokens"]),
    )


def _causes(cell: str, recomputed: int) -> str | None:
    """`recomputed_by`: a JSON object of tier -> whole tokens that add up to the record's
    recomputed tokens, stored as `causes_text` writes it; empty: not known."""
    if not cell:
        return None
    try:
        causes = json.loads(cell)
    except ValueError:
        raise BadRow(f"recomputed_by is not JSON: {cell[:40]!r}") from None
    if not isinstance(causes, dict) or not all(
        isinstance(k, str) and len(k) <= LIMITS["tier"] and type(v) is int and 0 <= v <= MAX_COUNT
        for k, v in causes.items()
    ):
        raise BadRow('recomputed_by is not an object of tier -> tokens, e.g. {"premium": 120}')
    if sum(causes.values()) != recomputed:
        raise BadRow("recomputed_by does not add up to recomputed_tokens")
    return causes_text(causes)


def _restore(cell: str) -> str:
    """Undo the export's spreadsheet guard ('=x -> =x)."""
    return cell[1:] if cell[:1] == "'" and cell[1:2] in FORMULA_STARTS and cell[1:] else cell


def _count(name: str, cell: str) -> int:
    if len(cell) > 12 or not (cell.isascii() and cell.isdigit()):  # int() takes "1_000", " 7"
        raise BadRow(f"{name} is not a whole number from 0 to {MAX_COUNT}: {cell[:40]!r}")
    value = int(cell)
    if value > MAX_COUNT:
        raise BadRow(f"{name} is above {MAX_COUNT}")
    return value


def _time(name: str, cell: str) -> float:
    try:
        value = float(cell)
    except ValueError:
        value = _iso_time(name, cell)
    if not TIME_RANGE[0] <= value <= TIME_RANGE[1]:  # NaN fails this too
        raise BadRow(f"{name} is not between 1970 and 9999: {cell[:40]!r}")
    return value


def _iso_time(name: str, cell: str) -> float:
    try:
        moment = datetime.fromisoformat(cell.replace("Z", "+00:00"))
    except ValueError:
        raise BadRow(f"{name} is not a time: {cell[:40]!r} (2026-11-01T12:00:00Z)") from None
    if moment.tzinfo is None:
        raise BadRow(f"{name} has no time zone: {cell[:40]!r} (end it with Z for UTC)")
    return moment.timestamp()


def _block_seconds(name: str, cell: str) -> float:
    try:
        value = float(cell)
    except ValueError:
        raise BadRow(f"{name} is not a number: {cell[:40]!r}") from None
    if not 0 <= value <= MAX_BLOCK_SECONDS:  # NaN fails this too
        raise BadRow(f"{name} must be a number from 0 to {MAX_BLOCK_SECONDS:.0e}")
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
