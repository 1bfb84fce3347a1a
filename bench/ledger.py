"""Ledger benchmark: ingest rate and FOCUS export memory at 1,000,000 records.

    python -m bench.ledger                    # 1,000,000 records on a temporary SQLite ledger
    python -m bench.ledger --quick            # 20,000 records (smoke test)
    python -m bench.ledger --url postgresql://...

Ingest goes through UsageLedger.write in batches of 512, as the server's
writer thread commits them; the export streams FOCUS rows (day granularity)
to a file while tracemalloc records the peak Python heap, which must not grow
with the number of records. Results: bench/results/ledger.{json,md}.
"""

from __future__ import annotations

import argparse
import random
import resource
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

from bench import report
from engine.tenancy import TierTable
from exporters.billing import FOCUS_COLUMNS, csv_chunks, focus_rows
from exporters.ledger import UsageLedger, UsageRecord

NOV = 1793491200.0  # 2026-11-01T00:00:00Z
TIERS = tuple(TierTable.shipped())


def records(n: int, tenants: int, seed: int = 7):
    rng = random.Random(seed)
    for i in range(n):
        t = rng.randrange(tenants)
        end = NOV + rng.random() * 30 * 86400
        prompt = rng.randint(20, 4000)
        yield UsageRecord(
            request_id=f"kvl-{i:032x}",
            tenant_id=f"tenant-{t:04d}",
            tier=TIERS[t % len(TIERS)],
            session_id=f"s{rng.randrange(10)}",
            model="kvlease-demo",
            started_at=end - 3,
            ended_at=end,
            input_tokens=prompt,
            cached_input_tokens=rng.randint(0, prompt),
            output_tokens=rng.randint(1, 1000),
            recomputed_tokens=rng.choice((0, 0, 0, 120)),
            preemptions=rng.choice((0, 0, 0, 1)),
            kv_block_seconds=rng.random() * 50,
            outcome="completed",
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--tenants", type=int, default=1_000)
    parser.add_argument("--quick", action="store_true", help="20,000 records")
    parser.add_argument("--url", default=None, help="ledger URL (default: temporary SQLite)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    n = 20_000 if args.quick else args.records
    workdir = Path(tempfile.mkdtemp(prefix="kvlease-bench-"))
    ledger = UsageLedger(args.url or f"sqlite:///{workdir / 'usage.db'}")

    started, batch = time.perf_counter(), []
    for record in records(n, args.tenants):
        batch.append(record)
        if len(batch) == 512:
            ledger.write(batch)
            batch = []
    ledger.write(batch)
    ingest_s = time.perf_counter() - started
    assert ledger.count() >= n

    tiers = TierTable.load()
    tracemalloc.start()
    started, rows = time.perf_counter(), 0
    with open(workdir / "focus.csv", "w", encoding="utf-8") as out:
        for chunk in csv_chunks(focus_rows(ledger.read(0, 4e9), "day", tiers), FOCUS_COLUMNS):
            out.write(chunk)
            rows += chunk.count("\n")
    export_s = time.perf_counter() - started
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()

    result = {
        "records": n,
        "tenants": args.tenants,
        "backend": ledger.engine.dialect.name,
        "ingest_seconds": round(ingest_s, 2),
        "ingest_records_per_s": round(n / ingest_s),
        "export_seconds": round(export_s, 2),
        "export_rows": rows - 1,
        "export_peak_python_heap_mb": round(peak / 2**20, 2),
        "max_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "machine": report.machine(),
    }
    table = (
        "| records | backend | ingest | FOCUS export | peak Python heap |\n|---|---|---|---|---|\n"
        f"| {n:,} | {result['backend']} | {result['ingest_records_per_s']:,}/s "
        f"| {export_s:.1f} s for {rows - 1:,} rows | {result['export_peak_python_heap_mb']} MB |\n"
    )
    report.write(args.out, "ledger-quick" if args.quick else "ledger", result, table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
