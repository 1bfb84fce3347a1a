"""Budgets: the file's rules, and the month's spend read from the ledger's rollups off the
request path (the server's 429 and warning header are in test_server)."""

from __future__ import annotations

import os
from decimal import Decimal

import pytest
from records import NOV, rec

from kvlease.engine.budgets import BudgetConfigError, BudgetTable, estimate
from kvlease.exporters.ledger import UsageLedger
from kvlease.exporters.pricing import record_cost
from kvlease.exporters.spend import SpendTracker

GOOD = """
refresh_seconds = 5
[tenants.acme]
monthly = "0.01"
on_exceed = "block"
[tenants.bob]
monthly = "100"
"""


def test_a_budget_file_loads_with_defaults(tmp_path):
    path = tmp_path / "budgets.toml"
    path.write_text(GOOD)
    table = BudgetTable.load(path)
    assert table.refresh_seconds == 5
    assert table.budgets["acme"].monthly == Decimal("0.01")
    assert table.budgets["acme"].on_exceed == "block" and table.budgets["bob"].on_exceed == "warn"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[tenants.a]\nmonthly = 'x'\n", "tenants.a.monthly is not a number"),
        ("[tenants.a]\nmonthly = '0'\n", "tenants.a.monthly must be above 0"),
        ("[tenants.a]\nmonthly = '1'\non_exceed = 'shout'\n", "must be one of warn, block"),
        ("[tenants.a]\nmontly = '1'\n", "unknown keys ['montly']"),
        ("[tenants.a]\n", "tenants.a has no monthly"),
        ("refresh_seconds = 0.1\n", "refresh_seconds must be at least 1"),
        ("alert = 1\n", "unknown keys ['alert']"),
        ("[tenants\n", "is not TOML"),
    ],
)
def test_a_bad_budget_file_is_one_line_naming_it(tmp_path, text, message):
    path = tmp_path / "budgets.toml"
    path.write_text(text)
    with pytest.raises(BudgetConfigError, match=r"budgets .*budgets\.toml") as caught:
        BudgetTable.load(path)
    assert message in str(caught.value) and "\n" not in str(caught.value)


@pytest.fixture
def ledger(tmp_path):
    ledger = UsageLedger(f"sqlite:///{tmp_path / 'usage.db'}")
    ledger.write(
        [
            rec(1, "acme", at=NOV + 3600),
            rec(2, "acme", at=NOV + 86400 * 20),
            rec(3, "acme", at=NOV - 3600),  # October: not this month's spend
            rec(4, "bob", tier="free", at=NOV + 3600),
            rec(5, "carol", at=NOV + 3600),  # no budget: never read
        ]
    )
    return ledger


def test_spend_is_this_months_billed_cost_of_the_budgeted_tenants(ledger, tiers, tmp_path):
    path = tmp_path / "budgets.toml"
    path.write_text(GOOD)
    tracker = SpendTracker(ledger, tiers, str(path), clock=lambda: NOV + 86400 * 25)
    assert tracker.verdict("acme") is None  # nothing read yet: never a scan on a request
    tracker.refresh()
    acme = tracker.verdict("acme")
    assert acme.spent == 2 * record_cost(rec(1, "acme"), tiers)
    assert acme.exceeded and acme.blocked and acme.ratio == pytest.approx(1.1)
    bob = tracker.verdict("bob")
    assert bob.spent == 0 and not bob.exceeded and not bob.blocked
    assert tracker.verdict("carol") is None
    assert set(tracker.verdicts()) == {"acme", "bob"}


def test_the_budget_file_is_reloaded_when_it_changes_and_a_bad_edit_is_ignored(
    ledger, tiers, tmp_path
):
    path = tmp_path / "budgets.toml"
    path.write_text(GOOD)
    tracker = SpendTracker(ledger, tiers, str(path), clock=lambda: NOV + 86400 * 25)
    path.write_text('[tenants.acme]\nmonthly = "1000"\n')
    os.utime(path, ns=(1, 1))  # a distinct mtime however fast the edit
    tracker.refresh()
    assert not tracker.verdict("acme").exceeded and tracker.verdict("bob") is None
    path.write_text("[tenants\n")
    os.utime(path, ns=(2, 2))
    tracker.refresh()
    assert tracker.verdict("acme").budget.monthly == Decimal("1000")  # the last good table


def test_requests_in_flight_hold_their_estimate_until_a_refresh_reads_their_record(
    ledger, tiers, tmp_path
):
    """40 requests arriving together once all passed on the same stale spend (1,837% of a
    block budget). Each now holds an upper bound of its cost under one lock."""
    path = tmp_path / "budgets.toml"
    path.write_text('[tenants.burst]\nmonthly = "0.005"\non_exceed = "block"\n')
    tracker = SpendTracker(ledger, tiers, str(path), clock=lambda: NOV + 86400 * 25)
    tracker.refresh()
    prices = tiers["standard"].prices
    one = estimate(200, {"max_tokens": 12}, 1, prices.input_per_1k, prices.output_per_1k)
    holds = [tracker.hold("burst", one) for _ in range(40)]
    admitted = [h for h in holds if h is not None]
    assert 0 < len(admitted) < 40
    assert len(admitted) * one <= Decimal("0.005") < (len(admitted) + 1) * one
    assert tracker.verdict("burst").spent == len(admitted) * one
    for hold in admitted:
        tracker.release(hold)
    assert tracker.hold("burst", one) is None  # ended, but no refresh has read them yet
    # Their records land (one here, cheaper than its estimate); the next refresh reads
    # it and lets every ended hold go.
    ledger.write([rec(100, "burst", "standard", at=NOV + 86400 * 25 - 60)])
    tracker.refresh()
    assert tracker.verdict("burst").spent == record_cost(rec(100, "burst", "standard"), tiers)
    assert tracker.hold("burst", one) is not None


def test_an_estimate_bounds_the_tokens_a_body_can_cost():
    doc = {"max_tokens": 12, "messages": [{"role": "user", "content": "hi"}]}
    price_in, price_out = Decimal("1"), Decimal("2")
    assert (
        estimate(100, doc, 3, price_in, price_out) == Decimal(3 * (100 + 256) + 2 * 3 * 12) / 1000
    )
    assert estimate(100, {}, 1, price_in, price_out) == Decimal(356 + 2 * 4096) / 1000
