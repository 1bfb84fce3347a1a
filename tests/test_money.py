"""The one rounding rule (`kvlease.exporters.money`): FOCUS at 10 places, people in minor units,
and a statement whose rounded lines add up to its rounded total."""

from __future__ import annotations

from decimal import Decimal

from hypothesis import given
from hypothesis import strategies as st

from kvlease.exporters import money

AMOUNTS = st.decimals(min_value=0, max_value=10**6, places=14, allow_nan=False)


def test_minor_units_follow_iso_4217():
    assert [money.minor_places(c) for c in ("USD", "EUR", "JPY", "KWD", "clf")] == [2, 2, 0, 3, 4]


def test_people_read_half_even_minor_units_with_thousands_separators():
    assert money.shown(Decimal("1234.565"), "USD") == "1,234.56"  # half even, not half up
    assert money.shown(Decimal("1234.575"), "USD") == "1,234.58"
    assert money.shown(Decimal("0.72657850919722222222222222222"), "USD") == "0.73"
    assert money.shown(Decimal("1234.5"), "JPY") == "1,234"
    assert money.shown(Decimal("-0.004"), "USD", sign=True) == "-0.00"
    assert money.shown(Decimal("2.5"), "EUR", sign=True) == "+2.50"


def test_focus_costs_have_ten_places_and_fit_a_spreadsheet_cell():
    text = money.focus_amount(Decimal("0.72657850919722222222222222222"))
    assert text == "0.7265785092"
    big = money.focus_amount(Decimal("99999.123456789012345"))
    assert big == "99999.1234567890" and len(big.replace(".", "")) == 15
    assert money.focus_amount(Decimal(0)) == "0.0000000000"
    assert money.focus_amount(Decimal("1E+3")) == "1000.0000000000"  # never exponent notation


def test_unit_prices_stay_as_the_tier_table_states_them():
    assert money.plain(Decimal("5E-7")) == "0.0000005"
    assert money.plain(Decimal("2.50")) == "2.5" and money.plain(Decimal(3)) == "3.0"


@given(st.lists(AMOUNTS, min_size=1, max_size=40))
def test_a_statements_rounding_line_makes_its_lines_add_up_to_its_total(lines):
    total = sum(lines, Decimal(0))
    adjust = money.rounding(lines, total, "USD")
    shown = sum((money.in_minor_units(x, "USD") for x in lines), Decimal(0))
    assert shown + adjust == money.in_minor_units(total, "USD")
    assert abs(adjust) <= Decimal("0.005") * len(lines)
