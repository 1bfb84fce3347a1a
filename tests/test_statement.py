"""One tenant's statement (`kvlease.exporters.statement`): priced lines that are the FOCUS rows,
a stable number, a named period, a CSV whose total has its own row type, and a page that
fits A4 portrait when Chromium prints it."""

from __future__ import annotations

import csv
import io
import os
import re
import shutil
from decimal import Decimal
from pathlib import Path

import pytest
from records import NOV, rec, retention

from kvlease.exporters import money
from kvlease.exporters.billing import Account
from kvlease.exporters.exports import export_chunks
from kvlease.exporters.ledger import UsageLedger
from kvlease.exporters.statement import period_name, statement, to_csv, to_html

DEC = NOV + 30 * 86400
SELLER = Account("acct-1", "Example Inference Ltd", "kvlease")


@pytest.fixture
def ledger(tmp_path) -> UsageLedger:
    ledger = UsageLedger(f"sqlite:///{tmp_path / 'u.db'}")
    ledger.write(
        [
            rec(1, "<b>acme</b>", at=NOV + 3600, kv_block_seconds=1.234567),
            rec(2, "<b>acme</b>", at=NOV + 86400 * 3, kv_block_seconds=7.654321),
            rec(3, "<b>acme</b>", model="other", at=NOV + 7200),
            rec(4, "<b>acme</b>", tier="standard", at=NOV + 7200),
            retention(5, 720.0, 5400.0, tenant="<b>acme</b>", at=NOV + 9000),
            rec(6, "bob", at=NOV + 7200),
        ]
    )
    return ledger


def _statement(ledger, tiers, tenant="<b>acme</b>", window=(NOV, DEC)):
    return statement(tenant, *window, ledger.rollups(*window, [tenant]), tiers, SELLER)


def _focus(ledger, tiers, tenant):
    text = "".join(export_chunks(ledger, (NOV, DEC), "focus", "month", tiers))
    return [r for r in csv.DictReader(io.StringIO(text)) if r["SubAccountId"] == tenant]


def test_a_line_per_priced_item_whose_exact_sum_is_the_focus_rows(ledger, tiers):
    s = _statement(ledger, tiers)
    assert [(x.model, x.tier, x.item) for x in s.lines][:4] == [
        ("m", "premium", "Input tokens (not served from the prefix cache)"),
        ("m", "premium", "Input tokens served from the prefix cache"),
        ("m", "premium", "Output tokens"),
        ("m", "premium", "KV-cache block-hours held"),
    ]
    assert [x.item for x in s.lines if x.item.startswith("KV retention")] == [
        "KV retention between turns, reserved",
        "KV retention between turns, retained",
    ]
    first = s.lines[0]
    assert (first.quantity, first.unit, first.priced_per) == (1200, "tokens", "1K tokens")
    assert first.unit_price == tiers["premium"].prices.input_per_1k
    assert first.exact == first.quantity / 1000 * first.unit_price
    rows = _focus(ledger, tiers, "<b>acme</b>")
    written = sum(Decimal(r["BilledCost"]) for r in rows)
    assert len(rows) == len(s.lines)  # one line per FOCUS row of the month
    assert abs(written - s.exact) <= len(rows) * Decimal("0.5e-10")
    assert s.total == money.in_minor_units(s.exact, "USD") and s.total.as_tuple().exponent == -2
    assert sum(s.amount(x) for x in s.lines) + s.rounding == s.total
    assert s.recomputed_tokens == 4 * 70


def test_the_statement_number_is_stable_for_a_tenant_and_period(ledger, tiers):
    a, again = _statement(ledger, tiers), _statement(ledger, tiers)
    assert re.fullmatch(r"KVL-202611-[0-9A-F]{8}", a.number) and a.number == again.number
    other_tenant = _statement(ledger, tiers, "bob")
    other_period = _statement(ledger, tiers, window=(NOV, NOV + 15 * 86400))
    assert len({a.number, other_tenant.number, other_period.number}) == 3


def test_periods_have_names():
    assert period_name(NOV, DEC) == "November 2026"
    assert period_name(NOV + 2 * 86400, NOV + 9 * 86400) == "3 Nov 2026 to 9 Nov 2026"
    assert period_name(NOV + 3600, NOV + 7200) == "2026-11-01 01:00 to 2026-11-01 02:00 UTC"


def test_the_csv_total_is_its_own_row_type_never_a_data_cell(ledger, tiers):
    s = _statement(ledger, tiers)
    rows = list(csv.DictReader(io.StringIO(to_csv(s).decode())))
    kinds = [r["row_type"] for r in rows]
    assert kinds == ["line"] * len(s.lines) + ["rounding"] * bool(s.rounding) + ["total"]
    assert "TOTAL" not in {r["model"] for r in rows}
    lines = sum(Decimal(r["amount"]) for r in rows if r["row_type"] != "total")
    assert lines == Decimal(rows[-1]["amount"]) == s.total
    assert {r["statement_number"] for r in rows} == {s.number}
    assert rows[-1]["item"] == rows[-1]["model"] == rows[-1]["quantity"] == ""
    assert rows[0]["tenant_id"] == "<b>acme</b>" and rows[0]["quantity"] == "1200"


def test_the_page_escapes_the_ledgers_text_and_shows_every_figure(ledger, tiers):
    s = _statement(ledger, tiers)
    page = to_html(s, generated=NOV)
    assert "&lt;b&gt;acme&lt;/b&gt;" in page and "<b>acme</b>" not in page
    assert "<script" not in page and "http" not in page  # self-contained
    for text in (s.number, "November 2026", "Example Inference Ltd", "acct-1", "1,200 tokens"):
        assert text in page
    assert f"{money.shown(s.total, 'USD')}</td>" in page
    assert money.focus_amount(s.exact) in page  # the exact total, at the FOCUS scale


ARTIFACTS = Path(
    os.environ.get("KVLEASE_TEST_ARTIFACTS", Path(__file__).parent.parent / "test-artifacts")
)
A4_PRINTABLE_PX = 180 / 25.4 * 96  # 210 mm less 15 mm margins each side, at 96 px an inch


def test_a_long_statement_prints_on_a4_portrait_in_chromium(tmp_path, tiers):
    """Printed to PDF by Chromium: every page A4 portrait and nothing wider than its
    printable width, for nine models' 36 priced lines and a long tenant id (the pages
    are saved as test artifacts, to look at)."""
    from playwright.sync_api import sync_playwright

    ledger = UsageLedger(f"sqlite:///{tmp_path / 'u.db'}")
    tenant = "tenant-with-a-rather-long-identifier-" + "x" * 40
    ledger.write(
        [
            rec(i, tenant, tier, model=f"meta-llama/Llama-3.1-{i}B-Instruct", at=NOV + 60 * i)
            for i, tier in enumerate(["premium", "standard", "free"] * 3)
        ]
    )
    s = _statement(ledger, tiers, tenant)
    assert len(s.lines) == 36
    html_file = tmp_path / "statement.html"
    html_file.write_text(to_html(s))
    with sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=shutil.which("chromium") or "/usr/bin/chromium",
            args=["--no-sandbox", "--disable-gpu"],
        )
        page = browser.new_page(viewport={"width": round(A4_PRINTABLE_PX), "height": 1000})
        page.goto(html_file.as_uri())
        page.emulate_media(media="print")
        widest = page.evaluate("() => document.documentElement.scrollWidth")
        pdf = page.pdf(prefer_css_page_size=True)
        browser.close()
    assert widest <= round(A4_PRINTABLE_PX)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    (ARTIFACTS / "statement.pdf").write_bytes(pdf)
    boxes = re.findall(rb"/MediaBox\s*\[\s*0 0 ([\d.]+) ([\d.]+)\s*\]", pdf)
    assert 1 < len(boxes) < 6  # 36 lines: a few pages, not one a line
    for width, height in boxes:
        assert (round(float(width)), round(float(height))) == (595, 842)  # A4 portrait, points
