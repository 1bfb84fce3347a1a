"""Per-tenant monthly budgets: the table, and what a month's spend against it means.

A small TOML file beside the tier table (`KVLEASE_BUDGETS`, or `kvlease serve
--budgets PATH`), reloaded when it changes:

    refresh_seconds = 30       # how stale the spend the server acts on may be (30)

    [tenants.acme]
    monthly = "500.00"         # in the tier table's currency, a decimal string
    on_exceed = "block"        # "warn" (the default): a response header; "block": HTTP 429

A budget covers a UTC calendar month. At `ALERT_RATIO` of it the gauge
`vllm_tenant_budget_used_ratio` fires the `KvleaseBudgetNearlySpent` alert. Spend is
what the usage ledger bills (the same cost as the FOCUS export), read from its rollups
away from the request path (`kvlease.exporters.spend`), so a request costs one dictionary
lookup. Standard library only.

Requests in flight are held against the budget: an admitted request holds `estimate`,
an upper bound of its token cost, until the first spend refresh after it ended has read
its record. A `block` budget refuses a request whose estimate would take spent + held
past the budget, so 40 requests arriving together cannot each see the old spend.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path

BUDGETS_ENV = "KVLEASE_BUDGETS"
# What a budgeted request without max_tokens (max_completion_tokens, max_output_tokens)
# is held at, in output tokens per choice.
HELD_OUTPUT_TOKENS = 4096
# Tokens a chat template may add beyond the body's own bytes (role markers, a system
# prompt): a body of B bytes is held at B + this many input tokens (a byte-level
# tokenizer makes at most one token a byte).
TEMPLATE_TOKENS = 256
ON_EXCEED = ("warn", "block")
ALERT_RATIO = 0.8


class BudgetConfigError(ValueError):
    """The budget file cannot be used; the message is one line naming the file."""


@dataclass(frozen=True)
class Budget:
    monthly: Decimal
    on_exceed: str = "warn"


@dataclass(frozen=True)
class Verdict:
    """A tenant's month so far against its budget."""

    budget: Budget
    spent: Decimal

    @property
    def ratio(self) -> float:
        return float(self.spent / self.budget.monthly)

    @property
    def exceeded(self) -> bool:
        return self.spent >= self.budget.monthly

    @property
    def blocked(self) -> bool:
        return self.exceeded and self.budget.on_exceed == "block"

    def refuses(self, estimate: Decimal) -> bool:
        """A `block` budget refuses a request that could take the spend past it."""
        return self.budget.on_exceed == "block" and self.spent + estimate > self.budget.monthly


def estimate(
    body_bytes: int, doc: dict, choices: int, input_per_1k: Decimal, output_per_1k: Decimal
) -> Decimal:
    """An upper bound of a request's token cost, from its body alone: every byte of the
    body (plus TEMPLATE_TOKENS) an uncached input token read by each choice, and each
    choice's output cap, or HELD_OUTPUT_TOKENS without one. KV block-hours are not held:
    a request's block time is unknown until it ends."""
    cap = next(
        (
            doc[key]
            for key in ("max_tokens", "max_completion_tokens", "max_output_tokens")
            if isinstance(doc.get(key), int) and not isinstance(doc[key], bool) and doc[key] > 0
        ),
        HELD_OUTPUT_TOKENS,
    )
    input_tokens = Decimal(choices * (body_bytes + TEMPLATE_TOKENS))
    output_tokens = Decimal(choices * min(cap, 2**31))
    return (input_tokens * input_per_1k + output_tokens * output_per_1k) / 1000


@dataclass(frozen=True)
class BudgetTable:
    budgets: dict[str, Budget]
    refresh_seconds: float = 30.0
    source: str = "(none)"

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> BudgetTable:
        where = str(path)
        try:
            doc = tomllib.loads(Path(path).read_text(encoding="utf-8"))
        except OSError as exc:
            raise BudgetConfigError(f"cannot read budgets {where}: {exc.strerror}") from None
        except tomllib.TOMLDecodeError as exc:
            raise BudgetConfigError(f"budgets {where} is not TOML: {exc}") from None
        unknown = set(doc) - {"refresh_seconds", "tenants"}
        if unknown:
            raise BudgetConfigError(f"budgets {where}: unknown keys {sorted(unknown)}")
        refresh = _number(doc.get("refresh_seconds", 30), "refresh_seconds", where)
        if refresh < 1:
            raise BudgetConfigError(f"budgets {where}: refresh_seconds must be at least 1")
        tenants = doc.get("tenants", {})
        if not isinstance(tenants, dict):
            raise BudgetConfigError(f"budgets {where}: [tenants] must be a table")
        return cls(
            {name: _budget(name, entry, where) for name, entry in tenants.items()},
            refresh,
            where,
        )

    def verdict(self, tenant_id: str, spent: Decimal) -> Verdict | None:
        budget = self.budgets.get(tenant_id)
        return None if budget is None else Verdict(budget, spent)


def _number(value: object, key: str, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BudgetConfigError(f"budgets {where}: {key} must be a number")
    return float(value)


def _budget(name: str, entry: object, where: str) -> Budget:
    if not isinstance(entry, dict):
        raise BudgetConfigError(f"budgets {where}: [tenants.{name}] must be a table")
    unknown = set(entry) - {"monthly", "on_exceed"}
    if unknown:
        raise BudgetConfigError(f"budgets {where}: tenants.{name}: unknown keys {sorted(unknown)}")
    try:
        monthly = Decimal(str(entry["monthly"]))
    except KeyError:
        raise BudgetConfigError(f"budgets {where}: tenants.{name} has no monthly") from None
    except InvalidOperation:
        message = f"budgets {where}: tenants.{name}.monthly is not a number"
        raise BudgetConfigError(message) from None
    if not monthly.is_finite() or monthly <= 0:
        raise BudgetConfigError(f"budgets {where}: tenants.{name}.monthly must be above 0")
    on_exceed = entry.get("on_exceed", "warn")
    if on_exceed not in ON_EXCEED:
        raise BudgetConfigError(
            f"budgets {where}: tenants.{name}.on_exceed must be one of {', '.join(ON_EXCEED)}"
        )
    return Budget(monthly, on_exceed)
