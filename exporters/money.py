"""How kvlease rounds money: one rule, in one place.

1. Inside, a cost is exact (`kvlease.exporters.pricing.Charges`): integers summed, divided once.
2. A FOCUS file writes every cost at `FOCUS_PLACES` (10) decimal places, half even, as
   the large clouds' usage files do: 15 significant digits fit a spreadsheet cell up to
   99,999 a row. Unit prices are written as the tier table states them; token
   quantities are integers; hour and 1K-token quantities are at `FOCUS_PLACES` too.
3. What a person reads (the live and usage pages, a statement, the CLI) is in the
   currency's minor unit (ISO 4217: 2 places for USD and EUR, 0 for JPY, 3 for KWD),
   half even, with thousands separators.
4. A statement line's amount is its exact cost in the minor unit; the total is the
   exact total in the minor unit, the same figure the pages show. When the lines'
   rounding does not add up to it, a "rounding" line says by how much (at most half a
   minor unit a line), so the document adds up and no figure is rounded twice.

Pure functions of `Decimal`s: no float ever touches an amount.
"""

from __future__ import annotations

from decimal import ROUND_HALF_EVEN, Decimal

FOCUS_PLACES = 10
_FOCUS_QUANTUM = Decimal(1).scaleb(-FOCUS_PLACES)
# ISO 4217 currencies whose minor unit is not 2 places (the list's active codes).
_MINOR_UNITS = {
    **dict.fromkeys(
        ("BIF", "CLP", "DJF", "GNF", "ISK", "JPY", "KMF", "KRW", "PYG", "RWF", "UGX", "UYI"),
        0,
    ),
    **dict.fromkeys(("VND", "VUV", "XAF", "XOF", "XPF"), 0),
    **dict.fromkeys(("BHD", "IQD", "JOD", "KWD", "LYD", "OMR", "TND"), 3),
    **dict.fromkeys(("CLF", "UYW"), 4),
}


def minor_places(currency: str) -> int:
    """Decimal places of `currency`'s minor unit (2 unless ISO 4217 says otherwise)."""
    return _MINOR_UNITS.get(currency.upper(), 2)


def in_minor_units(amount: Decimal, currency: str) -> Decimal:
    """`amount` rounded half even to `currency`'s minor unit (rule 3)."""
    return amount.quantize(Decimal(1).scaleb(-minor_places(currency)), ROUND_HALF_EVEN)


def shown(amount: Decimal, currency: str, sign: bool = False) -> str:
    """`amount` as a person reads it: `1,234.57` (`+1,234.57` with `sign`)."""
    places = minor_places(currency)
    return format(in_minor_units(amount, currency), f"{'+' if sign else ''},.{places}f")


def focus_amount(amount: Decimal) -> str:
    """A FOCUS cost or fractional quantity: plain notation at exactly 10 places (rule 2)."""
    return format(amount.quantize(_FOCUS_QUANTUM, ROUND_HALF_EVEN), "f")


def plain(value: Decimal) -> str:
    """A unit price as the tier table states it: plain notation, never `5E-7`, always a
    decimal point (so a reader that infers types reads a decimal column)."""
    text = format(value.normalize(), "f") if value else "0"
    return text if "." in text else f"{text}.0"


def rounding(lines: list[Decimal], total: Decimal, currency: str) -> Decimal:
    """What a statement adds to its rounded lines so that they sum to its rounded total
    (rule 4); 0 when they already do."""
    return in_minor_units(total, currency) - sum(
        (in_minor_units(x, currency) for x in lines), Decimal(0)
    )
