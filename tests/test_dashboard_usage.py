"""The usage page's figures (`kvlease.dashboard.usage`): from the rollups, priced as the FOCUS
export prices its rows, so every total is the export's to the digit."""

from __future__ import annotations

import csv
import io
import re
from decimal import Decimal

import pytest
from records import NOV, rec

from kvlease.dashboard import charts, usage
from kvlease.dashboard.data import SourceError
from kvlease.exporters.exports import export_chunks
from kvlease.exporters.ledger import UsageLedger
from kvlease.server.cli import main

DEC = NOV + 30 * 86400
OCT = NOV - 31 * 86400


def _rows(ledger, tiers, granularity="day", window=(NOV, DEC)) -> list[dict]:
    text = "".join(export_chunks(ledger, window, "focus", granularity, tiers))
    return list(csv.DictReader(io.StringIO(text)))


def test_tenant_totals_are_the_focus_rows_to_the_digit(november_ledger, tiers):
    finance = usage.load_finance(november_ledger.url, NOV, DEC, tiers)
    table = finance.tenants.set_index("tenant_id")
    assert table.loc["acme", "requests"] == 2 and table.loc["acme", "input_tokens"] == 2001
    assert table.loc["acme", "recomputed_tokens"] == 140 and table.loc["acme", "preemptions"] == 2
    assert table.loc["acme", "block_hours"] == Decimal("0.02")
    assert table.loc["acme", ["lease_covered_tokens", "lease_reused_tokens"]].tolist() == [320, 320]
    rows = _rows(november_ledger, tiers)
    for tenant in ("acme", "bob", "cy"):
        mine = [r for r in rows if r["SubAccountId"] == tenant]
        billed = sum(Decimal(r["BilledCost"]) for r in mine)
        # the exact cost; each row is written at 10 places (kvlease.exporters.money)
        assert abs(table.loc[tenant, "cost"] - billed) <= len(mine) * Decimal("0.5e-10")
    assert table.index[0] == "acme"  # largest cost first
    figure = charts.cost_bars(finance.tenants, tiers.currency)
    assert {t.name for t in figure.data} == {"premium", "free", "standard"}


def test_a_months_change_is_against_the_month_before(tmp_path, tiers):
    ledger = UsageLedger(f"sqlite:///{tmp_path / 'u.db'}")
    ledger.write(
        [
            rec(1, "acme", at=OCT + 7200),  # October: the period before November
            rec(2, "acme", at=NOV + 7200),
            rec(3, "acme", at=NOV + 9000),
            rec(4, "gone", tier="standard", at=OCT + 3600),  # quiet in November
        ]
    )
    finance = usage.load_finance(ledger.url, NOV, DEC, tiers)
    table = finance.tenants.set_index("tenant_id")
    one = table.loc["acme", "cost"] / 2
    assert table.loc["acme", "previous_cost"] == one
    assert table.loc["acme", "change"] == one
    assert table.loc["gone", "requests"] == 0 and table.loc["gone", "change"] < 0
    change = usage.change_percent(finance.tenants)
    percent = dict(zip(finance.tenants["tenant_id"], change, strict=True))
    assert percent["acme"] == pytest.approx(100.0) and percent["gone"] == pytest.approx(-100.0)


def test_cost_and_tokens_over_time_stack_days_by_tier_or_top_tenants(november_ledger, tiers):
    finance = usage.load_finance(november_ledger.url, NOV, DEC, tiers)
    total = float(sum(finance.tenants["cost"]))
    by_tier = usage.over_time(finance.daily, "tier")
    assert set(by_tier["series"]) == {"premium", "free", "standard"}
    assert by_tier["value"].sum() == pytest.approx(total)
    by_tenant = usage.over_time(finance.daily, "tenant", top=1)
    assert set(by_tenant["series"]) == {"acme", "other"}
    assert by_tenant["value"].sum() == pytest.approx(total)
    tokens = usage.over_time(finance.daily, "tier", measure="tokens")
    t = finance.tenants
    assert tokens["value"].sum() == t["input_tokens"].sum() + t["output_tokens"].sum()
    figure = charts.over_time(by_tier, tiers.currency, "tier")
    assert figure.layout.barmode == "stack" and len(figure.data) == 3
    assert figure.layout.xaxis.tickformat == "%b %-d"  # a day, not "00:00:00 Dec 1, 2026"


def test_the_pages_statement_reads_one_tenant_from_the_ledger_in_minor_units(tmp_path, tiers):
    ledger = UsageLedger(f"sqlite:///{tmp_path / 'u.db'}")
    ledger.write([rec(1, "acme", at=NOV + 3600), rec(2, "bob", at=NOV + 7200)])
    s = usage.load_statement(ledger.url, "acme", NOV, DEC, tiers)
    frame = usage.statement_frame(s)
    assert list(frame.columns) == ["item", "model", "tier", "quantity", "unit price", "amount"]
    assert list(frame["quantity"][:3]) == ["600 tokens", "400 tokens", "500 tokens"]
    assert list(frame["unit price"][:1]) == ["0.003 / 1K tokens"]
    assert all(re.fullmatch(r"\d+\.\d\d", amount) for amount in frame["amount"])


def test_reconciliation_compares_per_tenant_label_and_in_total():
    import pandas as pd

    tenants = pd.DataFrame(
        [
            {
                "tenant_id": "acme",
                "requests": 3,
                "input_tokens": 300,
                "cached_input_tokens": 0,
                "output_tokens": 30,
            },
            {
                "tenant_id": "tail",
                "requests": 1,
                "input_tokens": 100,
                "cached_input_tokens": 0,
                "output_tokens": 10,
            },
        ]
    )
    prometheus = {
        "requests": {"acme": 3.0, "__other__": 1.0},
        "input_tokens": {"acme": 290.0, "__other__": 100.0},
        "cached_input_tokens": {},
        "output_tokens": {"acme": 30.0, "__other__": 10.0},
    }
    table = usage.reconcile(tenants, prometheus).set_index(["tenant_id", "figure"])
    assert table.loc[("acme", "input_tokens"), "difference"] == -10.0
    assert table.loc[("__other__", "requests"), "ledger"] == 1  # beyond the labelled top-N
    assert table.loc[("(all)", "output_tokens"), "difference"] == 0.0


def test_the_page_csv_is_the_cli_export_byte_for_byte(november_ledger, tiers, tmp_path):
    page = usage.export_csv(november_ledger.url, NOV, DEC, "focus", "day", tiers)
    out = tmp_path / "cli.csv"
    window = ["--from", "2026-11-01", "--to", "2026-12-01", "--granularity", "day"]
    url = november_ledger.url
    assert main(["usage", "export", "--usage-db", url, *window, "-o", str(out)]) == 0
    assert page == out.read_bytes() and page.count(b"\n") == 1 + 3 * 4  # 3 tenants x 4 SKUs


def test_an_unreadable_ledger_is_a_source_error(tiers):
    with pytest.raises(SourceError, match="ledger is not readable"):
        usage.load_finance("postgresql://nobody@127.0.0.1:1/none", NOV, DEC, tiers)


def test_the_previous_window_is_whole_months_or_the_same_length():
    assert usage.previous_window(NOV, DEC) == (OCT, NOV)
    jan, mar = 1798761600.0, 1803859200.0  # 2027-01-01, 2027-03-01
    assert usage.previous_window(jan, mar) == (NOV, jan)
    assert usage.previous_window(NOV + 86400, NOV + 3 * 86400) == (NOV - 86400, NOV + 86400)


@pytest.mark.parametrize(
    ("preset", "window"),
    [
        ("This month", ("2026-12-01", "2027-01-01")),
        ("Last month", ("2026-11-01", "2026-12-01")),
        ("Last 30 days", ("2026-11-03", "2026-12-03")),
        ("Custom", ("2026-12-01", "2027-01-01")),
    ],
)
def test_period_presets_are_utc_windows_ending_exclusive(preset, window):
    from datetime import date

    lo, hi = usage.preset_window(preset, date(2026, 12, 2))
    assert (str(lo), str(hi)) == window


def test_the_tenant_table_leads_with_who_and_what_they_owe(november_ledger, tiers):
    finance = usage.load_finance(november_ledger.url, NOV, DEC, tiers)
    table = usage.tenant_table(finance.tenants, "USD")
    assert list(table.columns) == list(usage.TENANT_HEADERS.values())
    assert list(table["Cost"]) == [usage.money.shown(c, "USD") for c in finance.tenants["cost"]]
    assert set(table["Change %"]) == {"-"} and set(table["Budget this month"]) == {"-"}
    assert not table.isna().any().any()


def test_budgets_are_read_against_a_calendar_month_only(november_ledger, tiers):
    from kvlease.engine.budgets import Budget, BudgetTable

    finance = usage.load_finance(november_ledger.url, NOV, DEC, tiers)
    acme = finance.tenants.set_index("tenant_id").loc["acme", "cost"]
    table = BudgetTable({"acme": Budget(acme / Decimal("0.9")), "zed": Budget(Decimal(5))})
    status = usage.budget_status(finance.tenants, table, NOV, DEC, "USD").set_index("tenant_id")
    assert status.loc["acme", "status"].endswith("nearly spent")  # 90% >= ALERT_RATIO
    assert status.loc["zed", "status"] == "0% of 5.00"  # no usage: still listed
    assert usage.budget_status(finance.tenants, table, NOV, NOV + 86400, "USD").empty
    assert usage.budget_status(finance.tenants, None, NOV, DEC, "USD").empty


def test_a_tenants_requests_come_newest_first(november_ledger):
    frame = usage.load_requests(november_ledger.url, "acme", NOV, DEC, limit=1)
    assert list(frame["Request"]) == [f"kvl-{1:032x}"] and frame["Session"][0] == "-"


def test_a_requests_recomputed_tokens_show_whose_work_caused_them(tmp_path):
    ledger = UsageLedger(f"sqlite:///{tmp_path / 'u.db'}")
    ledger.write([rec(1, "bob", "free", recomputed_by='{"free":20,"premium":50}')])
    frame = usage.load_requests(ledger.url, "bob", NOV, DEC, limit=10)
    assert frame["Recomputed for (tier: tokens)"][0] == "premium: 50, free: 20"
