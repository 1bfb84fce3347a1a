"""Bounded tenant label values for metrics: a flood of tenants cannot flood /metrics.

Allow-listed tenants always keep their own label. Any other tenant takes one
of `max_labels` slots the first time it is seen and keeps it for the life of
the process, so every labelled counter stays monotonic; once the slots are
gone, later tenants share `__other__`. Requests without a tenant are
`__unclassified__`.

With `KVLEASE_HASH_TENANT_LABELS=1` a label is not the tenant id but a stable
keyed hash of it, `t_` + the first 16 hex digits of HMAC-SHA256(key, tenant id),
the key from `KVLEASE_TENANT_LABEL_KEY` (at least 32 bytes; the same in every
process and across restarts, so series continue): whoever reads /metrics learns
how much each tenant uses, not who the tenants are.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Iterable

OTHER = "__other__"
UNCLASSIFIED = "__unclassified__"
MAX_ENV = "KVLEASE_MAX_TENANT_LABELS"
ALLOW_ENV = "KVLEASE_TENANT_LABEL_ALLOWLIST"
HASH_ENV = "KVLEASE_HASH_TENANT_LABELS"
HASH_KEY_ENV = "KVLEASE_TENANT_LABEL_KEY"
MIN_HASH_KEY_BYTES = 32


def hashed_label(key: bytes, tenant: str) -> str:
    """The label of `tenant` when labels are hashed (operators compute it the same way)."""
    return "t_" + hmac.new(key, tenant.encode(), hashlib.sha256).hexdigest()[:16]


class TenantLabels:
    """tenant id -> label value. Invariant: at most len(allow) + max_labels + 2 distinct
    values; `_known` holds exactly the tenants with a label of their own. O(1) per lookup
    (one dict lookup once a tenant is known); memory O(len(allow) + max_labels)."""

    def __init__(
        self, max_labels: int = 500, allow: Iterable[str] = (), hash_key: bytes | None = None
    ) -> None:
        if max_labels < 0:
            raise ValueError("max_labels must be >= 0")
        self.max_labels = max_labels
        self.allow = frozenset(allow)
        self.hash_key = hash_key
        self._slots: set[str] = set()
        # The label of every tenant that has one of its own (allow-listed or in a slot):
        # one dict lookup on the scheduler's path, and a hashed label computed once.
        self._known: dict[str, str] = {}

    def __call__(self, tenant: str | None) -> str:
        label = self._known.get(tenant)  # type: ignore[arg-type]  # None is never a key
        if label is not None:
            return label
        if tenant is None:
            return UNCLASSIFIED
        if tenant not in self.allow:
            if len(self._slots) >= self.max_labels:
                return OTHER
            self._slots.add(tenant)
        label = self._known[tenant] = self._shown(tenant)
        return label

    def _shown(self, tenant: str) -> str:
        return tenant if self.hash_key is None else hashed_label(self.hash_key, tenant)

    @classmethod
    def from_env(cls) -> TenantLabels:
        raw = os.environ.get(MAX_ENV, "500")
        try:
            max_labels = int(raw)
        except ValueError:
            raise ValueError(f"{MAX_ENV} must be an integer, got {raw!r}") from None
        if max_labels < 0:
            raise ValueError(f"{MAX_ENV} must be 0 or more, got {raw!r}")
        allow = [t.strip() for t in os.environ.get(ALLOW_ENV, "").split(",") if t.strip()]
        return cls(max_labels, allow, hash_key_from_env())


def hash_key_from_env() -> bytes | None:
    """The label key when hashing is on, else None; ValueError with the fix if it is on
    without a usable key."""
    if os.environ.get(HASH_ENV, "").lower() not in ("1", "true", "yes", "on"):
        return None
    key = os.environ.get(HASH_KEY_ENV, "").encode()
    if len(key) < MIN_HASH_KEY_BYTES:
        raise ValueError(
            f"{HASH_ENV} is on: set {HASH_KEY_ENV} to at least {MIN_HASH_KEY_BYTES} bytes, "
            "the same for every process and restart (labels must stay stable)"
        )
    return key
