"""The usage export files, one function for every way out: `kvlease usage export`,
`/admin/usage.csv` and the dashboard's downloads all write these bytes.

- `focus`: FinOps FOCUS 1.2 rows from the rollups (`kvlease.exporters.billing`);
- `raw`: one row per ledger record, re-importable with `kvlease usage import`;
- `summary`: one row per tenant, its statement's total (`kvlease.exporters.statement`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from kvlease.engine.tenancy import TierTable
from kvlease.exporters.billing import RAW_COLUMNS, csv_chunks, focus_csv, raw_rows, usage
from kvlease.exporters.ledger import UsageLedger
from kvlease.exporters.rollups import DAY
from kvlease.exporters.statement import summary_chunks

FORMATS = ("focus", "raw", "summary")


def export_chunks(
    ledger: UsageLedger,
    window: tuple[float, float],
    fmt: str,
    granularity: str,
    tiers: TierTable,
    tenants: Sequence[str] = (),
) -> Iterator[str]:
    """The export file as CSV chunks, header first (`granularity` applies to FOCUS)."""
    if fmt == "raw":
        return csv_chunks(raw_rows(ledger.read(*window, tenants)), RAW_COLUMNS)
    if fmt == "summary":
        return summary_chunks(ledger.rollups(*window, tenants, DAY), window, tiers)
    if fmt != "focus":
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    return focus_csv(usage(ledger, window, granularity, tenants), granularity, tiers, window)
