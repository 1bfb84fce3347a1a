"""Bounded tenant label values for metrics: a flood of tenants cannot flood /metrics.

Allow-listed tenants always keep their own label. Any other tenant takes one
of `max_labels` slots the first time it is seen and keeps it for the life of
the process, so every labelled counter stays monotonic; once the slots are
gone, later tenants share `__other__`. Requests without a tenant are
`__unclassified__`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

OTHER = "__other__"
UNCLASSIFIED = "__unclassified__"
MAX_ENV = "KVLEASE_MAX_TENANT_LABELS"
ALLOW_ENV = "KVLEASE_TENANT_LABEL_ALLOWLIST"


class TenantLabels:
    """tenant id -> label value. Invariant: at most len(allow) + max_labels + 2 distinct
    values. O(1) per lookup; memory O(len(allow) + max_labels)."""

    def __init__(self, max_labels: int = 500, allow: Iterable[str] = ()) -> None:
        if max_labels < 0:
            raise ValueError("max_labels must be >= 0")
        self.max_labels = max_labels
        self.allow = frozenset(allow)
        self._slots: set[str] = set()

    def __call__(self, tenant: str | None) -> str:
        if tenant is None:
            return UNCLASSIFIED
        if tenant in self.allow or tenant in self._slots:
            return tenant
        if len(self._slots) < self.max_labels:
            self._slots.add(tenant)
            return tenant
        return OTHER

    @classmethod
    def from_env(cls) -> TenantLabels:
        raw = os.environ.get(MAX_ENV, "500")
        try:
            max_labels = int(raw)
        except ValueError:
            raise ValueError(f"{MAX_ENV} must be an integer, got {raw!r}") from None
        allow = [t.strip() for t in os.environ.get(ALLOW_ENV, "").split(",") if t.strip()]
        return cls(max_labels, allow)
