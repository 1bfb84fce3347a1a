"""Scheduler settings: read once when vLLM builds the scheduler.

vLLM constructs the scheduler itself (in the EngineCore process), so kvlease
cannot pass arguments to it. Settings come from vLLM's `--additional-config
'{"kvlease": {...}}'` first, then from `KVLEASE_*` environment variables,
then defaults. Both reach the EngineCore process.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvlease.engine.events import EVENT_CAPACITY
from kvlease.engine.policy import VictimRule
from kvlease.engine.reservations import ReserveMode, reserve_mode
from kvlease.engine.tenancy import TIERS_ENV, TierTable

KEYS = {
    "tiers": TIERS_ENV,
    "victim_rule": "KVLEASE_VICTIM_RULE",
    "debug_accounting": "KVLEASE_DEBUG_ACCOUNTING",
    "sample_seconds": "KVLEASE_SAMPLE_SECONDS",
    "event_capacity": "KVLEASE_EVENT_CAPACITY",
    "effective_tflops": "KVLEASE_EFFECTIVE_TFLOPS",
    "host_link_gbps": "KVLEASE_HOST_LINK_GBPS",
    "fair_share": "KVLEASE_FAIR_SHARE",
    "fair_slack": "KVLEASE_FAIR_SLACK",
    "reserve": "KVLEASE_RESERVE",
    # Each mechanism can be turned off on its own, to measure what it buys (bench/policy.py).
    "lease_order": "KVLEASE_LEASE_ORDER",
    "admission_preemption": "KVLEASE_ADMISSION_PREEMPTION",
    "class_service": "KVLEASE_CLASS_SERVICE",
    "reserve_payback": "KVLEASE_RESERVE_PAYBACK",
}


# Weighted tokens (a prompt token 1, a generated one 2) by which a tier's oldest waiting
# request may pass fair share's order: the knee of bench/results/seeds.md, where ten traces
# give the free tier's worst TTFT 1.20x stock PRIORITY's (median) against 1.54x at 0.
FAIR_SLACK = 3000.0
SAMPLE_SECONDS = 0.25  # how often occupancy is sampled, by default


class SettingsError(ValueError):
    """A scheduler setting is invalid; the message names the setting and its source."""


@dataclass(frozen=True)
class SchedulerSettings:
    tiers: TierTable
    victim_rule: VictimRule = VictimRule.LEAST_WORK
    debug_accounting: bool = False  # check the block invariant every step
    sample_seconds: float = SAMPLE_SECONDS  # how often occupancy is integrated
    event_capacity: int | None = None  # None: `events_kept` decides
    effective_tflops: float | None = None  # for the recompute-vs-offload cost model
    host_link_gbps: float | None = None  # GB/s device<->host, one way
    fair_share: bool = True  # weighted VTC inside each tier (off: FIFO within a tier)
    # weighted tokens by which the oldest waiting request may pass fair share's order
    # (kvlease.engine.waiting_queue.FairBucket); 0: strict fair share
    fair_slack: float = FAIR_SLACK
    reserve: ReserveMode | None = None  # every tier's `reserve` mode, if set (ablations)
    lease_order: bool = True  # off: a lease's unreserved blocks are plain LRU cached blocks
    admission_preemption: bool = True  # off: a waiting higher tier never preempts (stock)
    class_service: bool = True  # off: `running` is served first come first served (stock)
    reserve_payback: bool = True  # off: reservation caps stay at the tier table's (no payback)

    @classmethod
    def load(
        cls, additional: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None
    ) -> SchedulerSettings:
        env = os.environ if env is None else env
        given = dict((additional or {}).get("kvlease") or {})
        unknown = sorted(set(given) - set(KEYS))
        if unknown:
            raise SettingsError(
                f"additional_config.kvlease: unknown key {unknown[0]!r} (known: {', '.join(KEYS)})"
            )
        raw = {key: given.get(key, env.get(var)) for key, var in KEYS.items()}

        def where(key: str) -> str:
            return f"additional_config.kvlease.{key}" if key in given else KEYS[key]

        def number(
            key: str, low: float, default: float | None, inclusive: bool = False
        ) -> float | None:
            value = raw[key]
            if value is None or value == "":
                return default
            try:
                out = float(value)
            except (TypeError, ValueError):
                raise SettingsError(f"{where(key)} must be a number, got {value!r}") from None
            if not (out >= low if inclusive else out > low):
                bound = ">=" if inclusive else ">"
                raise SettingsError(f"{where(key)} must be {bound} {low:g}, got {value!r}")
            return out

        try:
            rule = VictimRule(raw["victim_rule"] or VictimRule.LEAST_WORK)
        except ValueError:
            raise SettingsError(
                f"{where('victim_rule')} must be 'lru' or 'least_work', got {raw['victim_rule']!r}"
            ) from None
        reserve = None
        if raw["reserve"] not in (None, ""):
            try:
                reserve = reserve_mode(raw["reserve"])
            except ValueError as exc:
                raise SettingsError(f"{where('reserve')} {exc}") from None
        debug = _flag(raw["debug_accounting"], False, where("debug_accounting"))
        fair = _flag(raw["fair_share"], True, where("fair_share"))
        switches = {
            key: _flag(raw[key], True, where(key))
            for key in ("lease_order", "admission_preemption", "class_service", "reserve_payback")
        }
        capacity = number("event_capacity", 0, None, inclusive=True)
        sample = number("sample_seconds", 0, SAMPLE_SECONDS)
        assert sample is not None
        slack = number("fair_slack", 0, FAIR_SLACK, inclusive=True)
        assert slack is not None
        return cls(
            tiers=TierTable.load(raw["tiers"]),
            victim_rule=rule,
            debug_accounting=debug,
            sample_seconds=sample,
            event_capacity=None if capacity is None else int(capacity),
            effective_tflops=number("effective_tflops", 0, None),
            host_link_gbps=number("host_link_gbps", 0, None),
            fair_share=fair,
            fair_slack=slack,
            reserve=reserve,
            **switches,
        )

    def events_kept(self, published: bool) -> int:
        """How many events the scheduler keeps: `event_capacity` if set, else
        EVENT_CAPACITY where a channel carries them to kvlease's API process (`published`)
        and none where nothing reads them (a plain `vllm serve --scheduler-cls`), so that
        engine holds no buffer of events nobody will read. An in-process reader (a test,
        `kvlease replay`) sets `event_capacity`."""
        if self.event_capacity is not None:
            return self.event_capacity
        return EVENT_CAPACITY if published else 0


def _flag(value: Any, default: bool, where: str) -> bool:
    if value in (None, ""):
        return default
    if isinstance(value, bool):
        return value
    text = str(value).lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise SettingsError(f"{where} must be true or false, got {value!r}")
