"""The usage page's figures (`dashboard.usage`): from the rollups, priced as the FOCUS
export prices its rows, so every total is the export's to the digit."""

from __future__ import annotations

import csv
import io
from decimal import Decimal

import pytest
from records import NOV, rec

from dashboard import charts, usage
from dashboard.data import SourceError
from exporters.billing import export_chunks
from exporters.ledger import UsageLedger
from server.cli import main

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
        billed = sum(Decimal(r["BilledCost"]) for r in rows if r["SubAccountId"] == tenant)
        assert table.loc[tenant, "cost"] == billed
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


def test_a_statement_has_a_line_per_model_and_tier_and_totals_the_month_rows(tmp_path, tiers):
    ledger = UsageLedger(f"sqlite:///{tmp_path / 'u.db'}")
    ledger.write(
        [
            rec(1, "<b>acme</b>", at=NOV + 3600),
            rec(2, "<b>acme</b>", at=NOV + 86400 * 3),
            rec(3, "<b>acme</b>", model="other", at=NOV + 7200),
            rec(4, "<b>acme</b>", tier="standard", at=NOV + 7200),
            rec(5, "bob", at=NOV + 7200),
        ]
    )
    s = usage.load_statement(ledger.url, "<b>acme</b>", NOV, DEC, tiers)
    assert [(x["model"], x["tier"], x["requests"]) for _, x in s.lines.iterrows()] == [
        ("m", "premium", 2),
        ("m", "standard", 1),
        ("other", "premium", 1),
    ]
    month = _rows(ledger, tiers, "month")
    assert s.total == sum(
        Decimal(r["BilledCost"]) for r in month if r["SubAccountId"] == "<b>acme</b>"
    )
    lines = list(csv.DictReader(io.StringIO(usage.statement_csv(s).decode())))
    assert lines[-1]["model"] == "TOTAL" and Decimal(lines[-1]["cost"]) == s.total
    assert lines[-1]["requests"] == "4"
    page = usage.statement_html(s)
    assert "&lt;b&gt;acme&lt;/b&gt;" in page and "<b>acme</b>" not in page
    assert "<script" not in page and str(s.total) in page


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
    page = usage.focus_csv(november_ledger.url, NOV, DEC, "day", tiers)
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
