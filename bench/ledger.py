"""Ledger benchmark at production volume: ingest, month export, usage page, memory.

    python -m bench.ledger                              # 1M and 10M records, SQLite and PostgreSQL
    python -m bench.ledger --records 1000000 --backend sqlite
    python -m bench.ledger --quick                      # 20,000 records (smoke test)

Each run measures kvlease against a plain reference on the same machine, the same
records and the same database server, in the same run:
- ingest: `UsageLedger.write` in batches of 4,096 (the server writer's largest group
  commit, which it reaches under load: one durable commit each, rollups maintained)
  against the fastest plain load, one transaction and no rollups (SQLite:
  `executemany`; PostgreSQL: `COPY`);
- month FOCUS export by day (`kvlease usage export`'s code, to a file) against one
  `GROUP BY` (tenant, model, tier, day) over the reference's raw rows;
- the usage page's month view (`kvlease.dashboard.data.load_finance`: daily rows, per-tenant
  totals, the previous period), which has no reference;
- peak Python heap during the export (tracemalloc, in a second, untimed export: tracing
  slows Python down) and the process's peak RSS;
- SQLite only: `kvlease usage import` of the records' raw export into a new ledger
  (every row parsed and bounded, rollups maintained) against a plain load of the same
  file (`csv.reader` into `executemany`, one transaction, no rollups).

Records arrive in end-time order, as a live ledger receives them, with random
`kvl-<uuid>` ids as the server gives them. Results: bench/results/ledger.{json,md}.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
import random
import resource
import sqlite3
import sys
import tempfile
import time
import tracemalloc
from contextlib import ExitStack
from pathlib import Path

from bench import report
from bench.postgres import postgres_cluster
from kvlease.dashboard.usage import load_finance
from kvlease.engine.tenancy import TierTable
from kvlease.exporters.billing import RAW_COLUMNS, csv_chunks, raw_rows
from kvlease.exporters.exports import export_chunks
from kvlease.exporters.ledger import COLUMNS, UsageLedger, UsageRecord
from kvlease.server import cli

NOV, DEC = 1793491200.0, 1796083200.0  # 2026-11-01 and 2026-12-01, 00:00Z
TIERS = tuple(TierTable.shipped())
BATCH = 4096  # kvlease.exporters.writer.LedgerWriter's largest group commit
GOALS = {"ingest_ratio": 0.2, "export_slack_s": 1.0, "export_ratio": 3.0, "page_s": 2.0}


def records(n: int, tenants: int, seed: int = 7):
    """`n` records over November, in end-time order; tenant activity is skewed (Zipf-like)
    as a chatbot service's is, and each tenant keeps its tier."""
    rng = random.Random(seed)
    weights = [1 / (k + 1) for k in range(tenants)]
    picks = rng.choices(range(tenants), weights, k=min(n, 1_000_000))
    span = DEC - NOV
    for i in range(n):
        t = picks[i % len(picks)]
        end = NOV + span * (i + rng.random()) / n
        prompt = rng.randint(20, 4000)
        yield UsageRecord(
            request_id=f"kvl-{rng.getrandbits(128):032x}",
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
            kv_block_seconds=round(rng.random() * 50, 6),
            outcome="completed",
        )


def batches(n: int, tenants: int, size: int):
    batch = []
    for record in records(n, tenants):
        batch.append(record)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def ingest(ledger: UsageLedger, n: int, tenants: int) -> float:
    """Seconds spent in `write` (record generation excluded)."""
    spent = 0.0
    for batch in batches(n, tenants, BATCH):
        started = time.perf_counter()
        ledger.write(batch)
        spent += time.perf_counter() - started
    return spent


# The reference: the same columns, the same primary key, nothing else.
REFERENCE_TABLE = (
    "CREATE TABLE reference (request_id VARCHAR(200) PRIMARY KEY, tenant_id VARCHAR(128),"
    " tier VARCHAR(32), session_id VARCHAR(128), model VARCHAR(200), started_at FLOAT,"
    " ended_at FLOAT, input_tokens INTEGER, cached_input_tokens INTEGER, output_tokens INTEGER,"
    " recomputed_tokens INTEGER, preemptions INTEGER, kv_block_seconds FLOAT, outcome TEXT,"
    " partial BOOLEAN, price_basis TEXT, lease_covered_tokens INTEGER,"
    " kv_reserved_block_seconds FLOAT, kv_retained_block_seconds FLOAT, recomputed_by TEXT)"
)
REFERENCE_EXPORT = (
    "SELECT tenant_id, model, tier, {day} AS day, count(*), sum(input_tokens),"
    " sum(cached_input_tokens), sum(output_tokens), sum(recomputed_tokens), sum(preemptions),"
    " sum(kv_block_seconds) FROM reference GROUP BY tenant_id, model, tier, day"
    " ORDER BY tenant_id, model, day"
)


def reference_sqlite(path: Path, n: int, tenants: int) -> tuple[float, float]:
    """(ingest seconds, export seconds) of plain sqlite3: executemany, one transaction."""
    db = sqlite3.connect(path)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute(REFERENCE_TABLE)
    marks = ", ".join("?" * len(COLUMNS))
    spent = 0.0
    for batch in batches(n, tenants, BATCH):
        rows = [tuple(getattr(r, c) for c in COLUMNS) for r in batch]
        started = time.perf_counter()
        db.executemany(f"INSERT INTO reference VALUES ({marks})", rows)
        spent += time.perf_counter() - started
    started = time.perf_counter()
    db.commit()
    spent += time.perf_counter() - started
    started = time.perf_counter()
    db.execute(REFERENCE_EXPORT.format(day="CAST(ended_at / 86400 AS INTEGER)")).fetchall()
    export = time.perf_counter() - started
    db.close()
    return spent, export


def reference_postgresql(url: str, n: int, tenants: int) -> tuple[float, float]:
    """(ingest seconds, export seconds) of plain psycopg: COPY, one transaction."""
    import psycopg

    with psycopg.connect(url) as db, db.cursor() as cursor:
        cursor.execute(REFERENCE_TABLE)
        spent = 0.0
        with cursor.copy(f"COPY reference ({', '.join(COLUMNS)}) FROM STDIN") as copy:
            for batch in batches(n, tenants, BATCH):
                rows = [tuple(getattr(r, c) for c in COLUMNS) for r in batch]
                started = time.perf_counter()
                for row in rows:
                    copy.write_row(row)
                spent += time.perf_counter() - started
        started = time.perf_counter()
        db.commit()
        spent += time.perf_counter() - started
        started = time.perf_counter()
        cursor.execute(REFERENCE_EXPORT.format(day="floor(ended_at / 86400)"))
        cursor.fetchall()
        export = time.perf_counter() - started
        cursor.execute("DROP TABLE reference")
        db.commit()
    return spent, export


def export_month(ledger: UsageLedger, tiers: TierTable, out: Path) -> tuple[float, int, float]:
    """(seconds, FOCUS rows, peak Python heap MB) of November's export by day."""

    def export() -> tuple[float, int]:
        started, rows = time.perf_counter(), 0
        with out.open("w", encoding="utf-8") as file:
            for chunk in export_chunks(ledger, (NOV, DEC), "focus", "day", tiers):
                file.write(chunk)
                rows += chunk.count("\n")
        return time.perf_counter() - started, rows - 1

    seconds, rows = export()
    tracemalloc.start()
    export()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return seconds, rows, peak / 2**20


def import_file(n: int, tenants: int, workdir: Path) -> tuple[float, float]:
    """(kvlease seconds, plain seconds) to load the same raw CSV of `n` records."""
    source = workdir / "raw.csv"
    with source.open("w", encoding="utf-8") as out:
        for chunk in csv_chunks(raw_rows(records(n, tenants)), RAW_COLUMNS):
            out.write(chunk)
    ledger = workdir / "imported.db"
    started = time.perf_counter()
    argv = ["usage", "import", str(source), "--usage-db", f"sqlite:///{ledger}", "--create"]
    with contextlib.redirect_stdout(io.StringIO()):
        assert cli.main(argv) == 0
    kvlease = time.perf_counter() - started
    assert UsageLedger(f"sqlite:///{ledger}", create=False).count() == n
    started = time.perf_counter()
    db = sqlite3.connect(workdir / "plain-import.db")
    db.execute("PRAGMA journal_mode=WAL")
    db.execute(REFERENCE_TABLE)
    marks = ", ".join("?" * len(COLUMNS))
    with source.open(encoding="utf-8", newline="") as rows:
        reader = csv.reader(rows)
        next(reader)
        db.executemany(f"INSERT INTO reference VALUES ({marks})", reader)
    db.commit()
    db.close()
    return kvlease, time.perf_counter() - started


def run(backend: str, n: int, tenants: int, workdir: Path) -> dict:
    tiers = TierTable.load()
    with ExitStack() as stack:
        if backend == "postgresql":
            url = stack.enter_context(postgres_cluster())
        else:
            url = f"sqlite:///{workdir / f'usage-{n}.db'}"
        ledger = UsageLedger(url)
        ingest_s = ingest(ledger, n, tenants)
        assert ledger.count() == n
        export_s, export_rows, heap_mb = export_month(ledger, tiers, workdir / "focus.csv")
        started = time.perf_counter()
        finance = load_finance(url, NOV, DEC, tiers)
        page_s = time.perf_counter() - started
        assert int(finance.tenants["requests"].sum()) == n
        ledger.engine.dispose()
        if backend == "postgresql":
            ref_ingest, ref_export = reference_postgresql(url, n, tenants)
        else:
            ref_ingest, ref_export = reference_sqlite(workdir / f"reference-{n}.db", n, tenants)
    imported = import_file(n, tenants, workdir) if backend == "sqlite" else None
    for leftover in [*workdir.glob("*.db*"), *workdir.glob("*.csv")]:
        leftover.unlink()
    return {
        "backend": backend,
        "records": n,
        "tenants": tenants,
        "ingest_records_per_s": round(n / ingest_s),
        "reference_ingest_records_per_s": round(n / ref_ingest),
        "ingest_ratio": round(ref_ingest / ingest_s, 3),
        "export_seconds": round(export_s, 2),
        "reference_export_seconds": round(ref_export, 2),
        "export_goal_seconds": round(GOALS["export_ratio"] * ref_export + 1, 2),
        "export_rows": export_rows,
        "page_seconds": round(page_s, 2),
        "export_peak_python_heap_mb": round(heap_mb, 2),
        "max_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        **(
            {
                "import_records_per_s": round(n / imported[0]),
                "reference_import_records_per_s": round(n / imported[1]),
                "import_ratio": round(imported[1] / imported[0], 3),
            }
            if imported
            else {}
        ),
    }


def table(results: list[dict]) -> str:
    lines = [
        "| records | backend | ingest (kvlease / plain) | ratio (goal >= 0.2) "
        "| month export by day (goal) | plain GROUP BY | usage page month (goal < 2 s) "
        "| peak Python heap | peak RSS | usage import (kvlease / plain load, goal >= 0.2x) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        imported = (
            f"{r['import_records_per_s']:,}/s / {r['reference_import_records_per_s']:,}/s: "
            f"{r['import_ratio']:.2f}x"
            if "import_ratio" in r
            else ""
        )
        lines.append(
            f"| {r['records']:,} | {r['backend']} | {r['ingest_records_per_s']:,}/s / "
            f"{r['reference_ingest_records_per_s']:,}/s | {r['ingest_ratio']:.2f}x "
            f"| {r['export_seconds']:.1f} s for {r['export_rows']:,} rows "
            f"(<= {r['export_goal_seconds']:.1f} s) | {r['reference_export_seconds']:.2f} s "
            f"| {r['page_seconds']:.2f} s | {r['export_peak_python_heap_mb']} MB "
            f"| {r['max_rss_mb']:,} MB | {imported} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, action="append", help="repeatable (1M, 10M)")
    parser.add_argument("--backend", choices=["sqlite", "postgresql"], action="append")
    parser.add_argument("--tenants", type=int, default=1_000)
    parser.add_argument("--quick", action="store_true", help="20,000 records")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    sizes = [20_000] if args.quick else args.records or [1_000_000, 10_000_000]
    backends = args.backend or ["sqlite", "postgresql"]
    workdir = Path(tempfile.mkdtemp(prefix="kvlease-bench-"))
    results = []
    for n in sizes:
        for backend in backends:
            results.append(run(backend, n, args.tenants, workdir))
            print(table(results[-1:]), flush=True)
    markdown = table(results)
    name = "ledger-quick" if args.quick else "ledger"
    report.write(args.out, name, {"runs": results, "machine": report.machine()}, markdown)
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
