"""The usage ledger and the FOCUS billing export, on SQLite (and PostgreSQL in the server tests)."""

from __future__ import annotations

import csv
import io
import re
from decimal import Decimal, localcontext

import pytest
from records import NOV, rec, retention

from kvlease.exporters.billing import FOCUS_COLUMNS, charge_groups, csv_chunks, focus_rows
from kvlease.exporters.exports import export_chunks
from kvlease.exporters.ledger import MIGRATIONS, SCHEMA_VERSION, OpenRecord, UsageLedger, rollup_of
from kvlease.exporters.periods import period
from kvlease.exporters.pricing import EXACT, per_block_us, record_cost
from kvlease.server.cli import main


@pytest.fixture(params=["sqlite", "postgresql"])
def ledger(request, tmp_path):
    """The same tests on the embedded SQLite ledger and on a real PostgreSQL server."""
    if request.param == "sqlite":
        return UsageLedger(f"sqlite:///{tmp_path / 'usage.db'}")
    url = request.getfixturevalue("postgres_url")
    ledger = UsageLedger(url)
    with ledger.engine.begin() as conn:  # a clean table per test
        for table in ("usage_records", "usage_rollups", "usage_retention"):
            conn.exec_driver_sql(f"DELETE FROM {table}")
    return ledger


def test_writes_are_idempotent_by_request_id(ledger):
    assert ledger.write([rec(1), rec(2)]) == 2
    assert ledger.write([rec(2), rec(3)]) == 1  # a replayed record changes nothing
    assert ledger.count() == 3


def test_schema_is_versioned_and_migration_is_idempotent(ledger):
    assert ledger.migrate() == SCHEMA_VERSION
    with ledger.engine.connect() as conn:
        versions = conn.exec_driver_sql("SELECT version FROM kvlease_schema").scalars().all()
    assert versions == sorted(set(versions)) == list(range(1, SCHEMA_VERSION + 1))


def test_replicas_starting_together_on_a_fresh_database_migrate_it_once(postgres_url):
    """A fleet's replicas open one new PostgreSQL ledger at the same moment."""
    import concurrent.futures

    import psycopg

    with psycopg.connect(postgres_url.replace("/kvlease", "/postgres"), autocommit=True) as c:
        c.execute("CREATE DATABASE together")
    url = postgres_url.replace("/kvlease", "/together")
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        found = list(pool.map(lambda _: UsageLedger(url).migrate(), range(6)))
    assert found == [SCHEMA_VERSION] * 6  # each found it migrated after opening it
    with UsageLedger(url).engine.connect() as conn:
        versions = conn.exec_driver_sql("SELECT version FROM kvlease_schema").scalars().all()
    assert sorted(versions) == list(range(1, SCHEMA_VERSION + 1))  # each version once


def test_a_version_1_ledger_is_migrated_and_keeps_its_records(tmp_path):
    """Records written before the `partial` column read back as complete."""
    import sqlite3

    path = tmp_path / "v1.db"
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE kvlease_schema (version INTEGER)")
        db.execute("INSERT INTO kvlease_schema VALUES (1)")
        for statement in MIGRATIONS[1]:
            db.execute(statement)
        db.execute(
            "INSERT INTO usage_records VALUES "
            "('kvl-old', 'acme', 'premium', NULL, 'm', 1.0, 2.0, 10, 0, 5, 0, 0, 0.5, 'completed')"
        )
    ledger = UsageLedger(f"sqlite:///{path}")
    [old] = ledger.read(0, 4e9)
    assert (old.request_id, old.output_tokens, old.partial) == ("kvl-old", 5, False)
    assert ledger.write([rec(1)]) == 1


def test_sqlite_runs_in_wal_mode(ledger):
    if ledger.engine.dialect.name != "sqlite":
        pytest.skip("WAL is SQLite's")
    with ledger.engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"


def test_read_streams_a_window_sorted_for_grouping(ledger):
    ledger.write(
        [rec(1, "b"), rec(2, "a", at=NOV + 10), rec(3, "a", at=NOV + 5), rec(4, "a", at=NOV - 5)]
    )
    got = [r.request_id[-1] for r in ledger.read(NOV, NOV + 86400)]
    assert got == ["3", "2", "1"]
    assert [r.tenant_id for r in ledger.read(NOV, NOV + 86400, ["b"])] == ["b"]


def test_cost_is_exact_and_recomputed_tokens_are_never_billed(tiers):
    p = tiers["premium"].prices
    expected = (
        Decimal(600) / 1000 * p.input_per_1k
        + Decimal(400) / 1000 * p.cached_input_per_1k
        + Decimal(500) / 1000 * p.output_per_1k
        + 36_000_000 * per_block_us(p.block_hour)  # 36 block-seconds, in microseconds
    )
    assert abs(expected - record_cost(rec(1), tiers)) < Decimal("1e-20")
    assert record_cost(rec(1), tiers) == expected
    assert record_cost(rec(1, recomputed_tokens=10**6), tiers) == expected
    assert record_cost(rec(1, tier=None), tiers) == 0


TIMESTAMP = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$")


def _focus(records, tiers, granularity="day", window=None) -> list[dict]:
    usage = map(rollup_of, records)
    text = "".join(csv_chunks(focus_rows(usage, granularity, tiers, window), FOCUS_COLUMNS))
    return list(csv.DictReader(io.StringIO(text)))


SKUS = ["kvlease-input-tokens", "kvlease-cached-input-tokens", "kvlease-output-tokens"]
SKUS.append("kvlease-kv-block-hours")
PLAIN_DECIMAL = re.compile(r"\d+\.\d+")
FIXED_10 = re.compile(r"\d+\.\d{10}")  # kvlease.exporters.money.FOCUS_PLACES
INTEGER = re.compile(r"\d+")
HALF_TEN_PLACES = Decimal("0.5e-10")  # the most one FOCUS row's rounding moves its cost


def test_focus_export_has_one_row_per_charge_with_its_unit_price(tiers):
    records = [
        rec(i, tenant, tier, at=NOV + 3600 * h)
        for i, (tenant, tier, h) in enumerate(
            [
                ("acme", "premium", 1),
                ("acme", "premium", 2),
                ("acme", "premium", 30),
                ("bob", "free", 1),
            ]
        )
    ]
    rows = _focus(records, tiers)
    assert [(r["SubAccountId"], r["ChargePeriodStart"], r["SkuId"]) for r in rows] == [
        (tenant, day, sku)
        for tenant, day in [
            ("acme", "2026-11-01T00:00:00Z"),
            ("acme", "2026-11-02T00:00:00Z"),
            ("bob", "2026-11-01T00:00:00Z"),
        ]
        for sku in SKUS
    ]
    for row in rows:
        assert set(FOCUS_COLUMNS) == set(row)
        for column in ("ChargePeriodStart", "ChargePeriodEnd", "BillingPeriodStart"):
            assert TIMESTAMP.match(row[column])
        assert PLAIN_DECIMAL.fullmatch(row["ListUnitPrice"])  # never 5E-7
        for column in ("BilledCost", "PricingQuantity", "x_BlockHours"):  # money.FOCUS_PLACES
            assert FIXED_10.fullmatch(row[column]), (column, row[column])
        tokens = row["ConsumedUnit"] == "Tokens"
        assert (INTEGER if tokens else FIXED_10).fullmatch(row["ConsumedQuantity"])
        assert row["BilledCost"] == row["EffectiveCost"] == row["ListCost"] == row["ContractedCost"]
        unit, quantity = Decimal(row["ListUnitPrice"]), Decimal(row["PricingQuantity"])
        # Within the one rounding, at 10 places, of the exact cost.
        assert abs(Decimal(row["ListCost"]) - unit * quantity) <= Decimal("0.5e-10")
        assert row["BillingCurrency"] == "USD" and row["ChargeCategory"] == "Usage"
        assert row["CommitmentDiscountId"] == row["RegionId"] == ""  # null: does not apply
    first = rows[:4]
    premium = tiers["premium"].prices
    assert [Decimal(r["ListUnitPrice"]) for r in first] == [
        premium.input_per_1k,
        premium.cached_input_per_1k,
        premium.output_per_1k,
        premium.block_hour,
    ]
    assert [r["ConsumedQuantity"] for r in first[:3]] == ["1200", "800", "1000"]
    billed = sum(Decimal(r["BilledCost"]) for r in first)
    assert abs(billed - 2 * record_cost(records[0], tiers)) <= 4 * HALF_TEN_PLACES
    # Request-level figures ride on the input row, so a column's sum is the total.
    assert first[0]["x_Requests"] == "2" and first[0]["x_InputTokens"] == "2000"
    assert first[0]["x_RecomputedTokens"] == "140"
    assert {r["x_Requests"] for r in first[1:]} == {"0"}
    assert all(Decimal(r["BilledCost"]) == 0 for r in rows[8:])  # free tier
    assert first[0]["BillingPeriodEnd"] == "2026-12-01T00:00:00Z"


def test_row_keys_are_stable_and_unique_per_charge(tiers):
    records = [rec(1), rec(2, model="other"), rec(3, at=NOV + 90000)]
    keys = [r["x_RowKey"] for r in _focus(records, tiers)]
    assert len(set(keys)) == 3 * 4
    assert keys == [r["x_RowKey"] for r in _focus(list(reversed(records[:1])) + records[1:], tiers)]


def test_partial_period_exports_are_clipped_and_never_share_a_row_key(tiers):
    mid = NOV + 15 * 86400
    records = [rec(1, at=NOV + 3600), rec(2, at=mid + 3600)]
    first = _focus(records[:1], tiers, "month", (NOV, mid))
    second = _focus(records[1:], tiers, "month", (mid, NOV + 30 * 86400))
    assert {r["ChargePeriodEnd"] for r in first} == {"2026-11-16T00:00:00Z"}
    assert {r["ChargePeriodStart"] for r in second} == {"2026-11-16T00:00:00Z"}
    assert not {r["x_RowKey"] for r in first} & {r["x_RowKey"] for r in second}


def test_every_granularity_bills_the_same_total_to_the_last_digit(tiers):
    """Block time is summed in whole microseconds and priced per microsecond, rounded once:
    records, hours, days and the month give one total (they once differed at ...6652,
    ...6660 and ...6666)."""
    records = [
        rec(i, at=NOV + i * 997, kv_block_seconds=1.234567 * (i + 1), tier="standard")
        for i in range(200)
    ]
    with localcontext(EXACT):  # a spreadsheet's float sum rounds; this must not
        by_record = sum((record_cost(r, tiers) for r in records), Decimal(0))
        for granularity in ("hour", "day", "month"):
            usage = [rollup_of(r) for r in records]
            groups = charge_groups(usage, granularity, tiers)
            assert sum((g.charges.cost for g in groups), Decimal(0)) == by_record
            # Written at 10 places, each row within half of its last place of its cost.
            rows = _focus(records, tiers, granularity)
            written = sum(Decimal(r["BilledCost"]) for r in rows)
            assert abs(written - by_record) <= len(rows) * HALF_TEN_PLACES


def test_cells_a_spreadsheet_would_run_are_made_inert(tiers):
    rows = _focus([rec(1, tenant="-x", model='=HYPERLINK("http://evil")')], tiers)
    assert rows[0]["SubAccountId"] == "'-x" and rows[0]["x_Model"].startswith("'=")


@pytest.mark.parametrize("fmt", ["raw", "focus"])
def test_a_bare_carriage_return_never_starts_a_row(ledger, tiers, fmt):
    """`acme\r=SUM(1;2)` unquoted was a new row that began with a formula in a spreadsheet."""
    ledger.write([rec(1, tenant="acme\r=SUM(1;2)", model="m\rx"), rec(2, "bob")])
    text = "".join(export_chunks(ledger, (NOV, NOV + 30 * 86400), fmt, "month", tiers))
    # A spreadsheet splits rows at any line break outside quotes, \r included.
    rows, cell, quoted = [[]], "", False
    for ch in text:
        if ch == '"':
            quoted = not quoted
        elif ch in "\r\n" and not quoted:
            rows[-1].append(cell)
            rows.append([])
            cell = ""
            continue
        cell += ch
    lines = [r for r in rows if r]
    records = list(csv.reader(io.StringIO(text, newline="")))
    assert len(lines) == len(records)
    if fmt == "raw":
        assert len(records) == 3  # the header and two records


@pytest.mark.parametrize(
    ("granularity", "length"), [("hour", 3600), ("day", 86400), ("month", 30 * 86400)]
)
def test_periods(granularity, length):
    start, end = period(NOV + 4000, granularity)
    assert start == (NOV + 3600 if granularity == "hour" else NOV)
    assert end - start == length


def _export(ledger, *extra: str) -> int:
    """`kvlease usage export` over November 2026."""
    window = ["--from", "2026-11-01", "--to", "2026-12-01"]
    return main(["usage", "export", "--usage-db", ledger.url, *window, *extra])


def test_cli_export_writes_focus_and_raw_csv(ledger, tiers, tmp_path, capsys):
    ledger.write([rec(1), rec(2, "bob", "free")])
    out = tmp_path / "nov.csv"
    assert _export(ledger, "--granularity", "month", "-o", str(out)) == 0
    rows = list(csv.DictReader(out.open()))
    assert [r["SubAccountId"] for r in rows] == ["acme"] * 4 + ["bob"] * 4
    assert _export(ledger, "--format", "raw", "--tenant", "bob") == 0
    raw = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert [r["tenant_id"] for r in raw] == ["bob"] and raw[0]["ended_at"].endswith("Z")
    bad = main(["usage", "export", "--usage-db", ledger.url, "--from", "yesterday"])
    assert bad == 2


def test_a_record_the_database_refuses_is_set_aside_and_never_blocks_the_others(ledger, tmp_path):
    """One bad record in a batch: bisected out to the dead-letter file, the rest commit,
    and a response waiting for the bad one is released, not held."""
    import asyncio
    import dataclasses
    import json

    from kvlease.exporters.writer import LedgerWriter

    bad = dataclasses.replace(rec(3), model=None)  # NOT NULL, on every backend
    batch = [rec(1), rec(2), bad, rec(4), rec(5)]
    if ledger.engine.dialect.name == "postgresql":
        batch.append(dataclasses.replace(rec(6), tenant_id="t" * 129))  # VARCHAR(128)
    dead = tmp_path / "dead.jsonl"
    writer = LedgerWriter(ledger, dead_letter_path=dead)

    async def wait_for_the_bad_one():
        released = writer.expect(bad.request_id)
        writer._commit(batch)  # as the writer thread would, in one batch
        await asyncio.wait_for(released, 5)

    asyncio.run(wait_for_the_bad_one())
    writer.close()
    assert ledger.count() == 4
    lines = [json.loads(line) for line in dead.read_text().splitlines()]
    assert writer.dead_letters == len(lines) == len(batch) - 4
    assert lines[0]["record"]["request_id"] == bad.request_id and lines[0]["reason"]
    assert writer.write_errors == 0  # a data error is not a database outage
    assert dead.stat().st_mode & 0o777 == 0o600


def test_the_dead_letter_file_is_bounded(ledger, tmp_path, monkeypatch):
    import dataclasses

    from kvlease.exporters.writer import DEAD_LETTER_MAX_ENV, LedgerWriter

    monkeypatch.setenv(DEAD_LETTER_MAX_ENV, "10000")
    dead = tmp_path / "dead.jsonl"
    writer = LedgerWriter(ledger, dead_letter_path=dead)
    bad = [dataclasses.replace(rec(i), model=None, tenant_id="t" * 100) for i in range(200)]
    for record in bad:
        writer._commit([record])
    writer.close()
    assert writer.dead_letters == 200  # every refusal is counted
    assert 0 < dead.stat().st_size <= 10_000


def test_a_new_ledger_and_its_folder_are_private(tmp_path):
    home = tmp_path / "home" / "kvlease"
    UsageLedger(f"sqlite:///{home / 'usage.db'}")
    assert home.stat().st_mode & 0o777 == 0o700
    for path in home.glob("usage.db*"):
        assert path.stat().st_mode & 0o777 == 0o600, path


def _table(input_price: str, currency: str = "USD", tier: str = "premium"):
    from kvlease.engine.tenancy import TierTable

    return TierTable.from_toml(
        f'currency = "{currency}"\n[tiers.{tier}]\npriority = 0\nlease_seconds = 60\n'
        f'leased_cache_cap = 0.5\n[tiers.{tier}.prices]\ninput_per_1k = "{input_price}"\n'
        'cached_input_per_1k = "0"\noutput_per_1k = "0"\nblock_hour = "0"\n'
    )


def test_a_record_keeps_the_prices_it_was_written_with(tmp_path):
    """A later change of the tier table never reprices history."""
    from kvlease.exporters.writer import to_record

    finished = _finished_premium_request()
    then = _table("0.0030")
    record = to_record(finished, then)
    assert record.price_basis is not None
    ledger = UsageLedger(f"sqlite:///{tmp_path / 'usage.db'}")
    ledger.write([record])
    [stored] = ledger.read(0, 4e9)
    now = _table("0.9000")  # a price rise after the fact
    assert record_cost(stored, now) == record_cost(stored, then) == Decimal("0.003")


def test_an_export_that_cannot_price_a_record_says_so_and_exits_2(tmp_path, capsys):
    ledger = UsageLedger(f"sqlite:///{tmp_path / 'usage.db'}")
    ledger.write([rec(1, tier="gold")])  # no stored prices; the tier was renamed since
    code = main(["usage", "export", "--usage-db", ledger.url, "--from", "2026-11-01"])
    assert code == 2
    assert "tier 'gold' is not in the tier table" in capsys.readouterr().err


def test_a_record_priced_in_another_currency_is_refused():
    from kvlease.exporters.pricing import UnpricedRecord
    from kvlease.exporters.writer import to_record

    euro = to_record(_finished_premium_request(), _table("1", currency="EUR"))
    with pytest.raises(UnpricedRecord, match="EUR"):
        record_cost(euro, _table("1"))


def _finished_premium_request():
    from types import SimpleNamespace

    from kvlease.engine.tenancy import TenantContext
    from kvlease.exporters.join import FinishedRequest, InFlight

    stats = SimpleNamespace(
        request_id="kvl-" + "a" * 32,
        finish_reason=1,
        num_prompt_tokens=1000,
        num_cached_tokens=0,
        num_generation_tokens=0,
        num_preemptions=0,
        e2e_latency=1.0,
    )
    entry = InFlight(TenantContext("acme", "premium"), "/v1/completions", int(NOV * 1e9))
    return FinishedRequest("kvl-" + "a" * 32, 0.0, entry, [stats])


def test_what_leasing_bought_is_on_the_input_row_covered_and_reused(tiers):
    records = [
        rec(1, lease_covered_tokens=320),  # 400 cached of which the lease kept 320
        rec(2, lease_covered_tokens=640),  # the cache served only 400 of the lease's 640
        rec(3),  # a first turn: nothing leased
    ]
    [first, *others] = _focus(records, tiers)[:4]
    assert (first["x_LeaseCoveredTokens"], first["x_LeaseReusedTokens"]) == ("960", "720")
    assert {(r["x_LeaseCoveredTokens"], r["x_LeaseReusedTokens"]) for r in others} == {("0", "0")}


def test_kv_retention_is_its_own_sku_priced_reserved_and_retained_apart(ledger, tiers):
    """Two requests and the time between them: 720 reserved and 5,400 retained
    block-seconds (0.2 and 1.5 block-hours) at the tier's two retention prices, on two
    rows of one SKU, beside the four request rows; the records count as 2 requests."""
    ledger.write([rec(1), retention(1, 720.0, 5400.0), rec(2)])
    rows = [dict(r) for r in focus_rows(ledger.rollups(NOV, NOV + 86400), "day", tiers)]
    assert [r["SkuId"] for r in rows] == [*SKUS, "kvlease-kv-retention", "kvlease-kv-retention"]
    p = tiers["premium"].prices
    reserved, retained = rows[4:]
    assert (reserved["ConsumedQuantity"], retained["ConsumedQuantity"]) == (
        "0.2000000000",
        "1.5000000000",
    )
    assert (Decimal(reserved["ListUnitPrice"]), Decimal(retained["ListUnitPrice"])) == (
        p.reserved_block_hour,
        p.retained_block_hour,
    )
    # priced per whole block-microsecond, as the block-hours are, and written at 10 places
    for row, hours, price in (
        (reserved, "0.2", p.reserved_block_hour),
        (retained, "1.5", p.retained_block_hour),
    ):
        assert abs(Decimal(row["BilledCost"]) - Decimal(hours) * price) <= HALF_TEN_PLACES
    assert reserved["SkuMeter"] == "KV Retention Block-Hours"
    assert reserved["SkuPriceId"].startswith("kv-retention:reserved:premium:")
    assert len({r["x_RowKey"] for r in rows}) == 6
    assert rows[0]["x_Requests"] == "2"
    total = sum(Decimal(r["BilledCost"]) for r in rows)
    exact = sum(record_cost(r, tiers) for r in ledger.read(NOV, NOV + 86400))
    assert abs(total - exact) <= len(rows) * HALF_TEN_PLACES
    assert ledger.write([retention(1, 720.0, 5400.0)]) == 0  # idempotent by its key


def test_records_keep_the_lease_covered_tokens_through_the_database(tmp_path):
    ledger = UsageLedger(f"sqlite:///{tmp_path / 'usage.db'}")
    ledger.write([rec(1, lease_covered_tokens=256)])
    [back] = list(ledger.read(0, 4e9))
    assert back.lease_covered_tokens == 256


def _open(i: int, tokens: int, updated_at: float, owner: str = "gone") -> OpenRecord:
    return OpenRecord(
        rec(i).request_id, "acme", "premium", "s1", "m", NOV, updated_at, tokens, None, owner
    )


def test_a_stream_its_server_stopped_journaling_is_billed_as_a_partial_record(ledger):
    """kill -9 mid-stream once left the tokens already streamed without a record."""
    ledger.journal([_open(1, 10, NOV + 5), _open(2, 30, NOV + 5)])
    ledger.journal([_open(1, 25, NOV + 10)])  # refreshed: later, more output
    assert ledger.recover_open(NOV + 6) == 1  # only the one not refreshed since
    [cut] = ledger.read(0, 4e9)
    assert (cut.request_id, cut.output_tokens, cut.partial, cut.outcome) == (
        rec(2).request_id,
        30,
        True,
        "aborted",
    )
    assert cut.ended_at == NOV + 5 and cut.session_id == "s1"
    assert ledger.recover_open(NOV + 6) == 0  # recovered once


def test_a_server_never_bills_its_own_live_streams_as_cut(ledger):
    ledger.journal([_open(1, 10, NOV + 5, owner="me")])
    assert ledger.recover_open(NOV + 100, owner="me") == 0  # starved, not gone
    assert ledger.recover_open(NOV + 100, owner="a-restarted-server") == 1


def test_a_final_record_closes_its_open_record_and_is_the_only_one(ledger):
    ledger.journal([_open(1, 10, NOV + 5)])
    ledger.write([rec(1)])  # the request ended normally
    ledger.journal([_open(1, 12, NOV + 6)])  # a late tick after the record: ignored
    assert ledger.recover_open(NOV + 100) == 0
    [only] = ledger.read(0, 4e9)
    assert only == rec(1)
